"""Reward-model training (Bradley-Terry) on Ray Train + DeepSpeed, resumable after a lost worker.

Driver, `train_reward_model`: checks the input (empty sets, overlength pairs under "reject",
fewer pairs than one global batch, more workers than the Ray cluster has CPUs/GPUs) before
anything starts, puts the tokenized pairs in the object store and runs a `TorchTrainer`.

Worker, `_train_loop`: every optimizer step reads only this rank's part of the epoch's
shuffled order (`rlhf_core.data.pairs.rank_step_indices`), runs `grad_accum_steps`
micro-batches through the DeepSpeed engine, gathers every rank's step time and consumed
indices and computes flat `reward/*` metrics, which rank 0 passes to `on_metrics`. Every
`checkpoint_every` steps and after the last one it reports a checkpoint and waits until Ray
Train has committed it; after a worker dies Ray Train restarts the group (up to
`max_failures` times) and every rank resumes from the latest committed checkpoint at
exactly the next batch. At the end all ranks gather the full fp32
parameters, and rank 0 scores the held-out pairs, computes the normalisation stats and
saves the model in HF format.

A checkpoint (`rlhf_core.distributed.checkpoint`) holds the engine under the tag `engine`
and, in trainer_state.json, the next data position and the per-step consumed pair indices and
metrics history of every committed step. The Ray Train and DeepSpeed plumbing this stage shares
with policy optimisation is in `rlhf_core.distributed.stage`, `.checkpoint` and
`.deepspeed_engine`.
"""
from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification

from rlhf_core.algos.losses import bradley_terry_loss, ensemble_bradley_terry_loss
from rlhf_core.config import RewardConfig
from rlhf_core.data.pairs import (
    DataPosition, TokenizedPairs, collate_pairs, split_by_prompt, steps_per_epoch, tokenize_pairs,
)
from rlhf_core.distributed import deepspeed_engine, train_context
from rlhf_core.distributed.deepspeed_engine import full_fp32_parameters, module_grad_norm, warmup_cosine_lr
from rlhf_core.distributed.epochs import RankStep, run_epochs
from rlhf_core.distributed.stage import (
    StageRecord,
    StageRuntime,
    agreed_precision,
    evaluation_device,
    fit_stage,
    start_worker,
)
from rlhf_core.distributed.worker_meter import WorkerMeter
from rlhf_core.models.reward import (
    AUDIT_DIR, freeze_lower_layers, member_mean, reward_model_from_base, reward_stats, save_reward_model, score_pairs_members,
)
from rlhf_core.tokenizer import load_tokenizer
from rlhf_core.training.precision import Precision, computing_in
from rlhf_core.training.stage_types import MetricsCallback, StageFailed, StageSite, StageStopped

Pairs = Sequence[Mapping[str, Any]]  # preference pairs: prompt, chosen, rejected, optional id

ENGINE_TAG = "engine"


@dataclass(frozen=True)
class RewardTrainResult:
    path: Path  # HF directory of the trained reward model
    eval_accuracy: float  # held-out pairwise accuracy (r_chosen > r_rejected)
    eval_loss: float  # held-out Bradley-Terry loss
    reward_mean: float  # normalisation stats over the held-out chosen + rejected responses
    reward_std: float
    steps: int  # optimizer steps committed
    final_loss: float  # training loss of the last step
    truncated: int  # training pairs cut to max_length
    run: StageRecord  # attempts, seconds, checkpoint; per step the pair indices of all ranks and the metrics
    member_eval_accuracy: list[float] = field(default_factory=list)  # per ensemble member (one: the model's own)


# ----------------------------------------------------------------------------- driver


def train_reward_model(train_pairs: Pairs, eval_pairs: Pairs, base_dir: Path, cfg: RewardConfig,
                       site: StageSite) -> RewardTrainResult:
    """Train a reward model from the SFT policy in `base_dir` on `train_pairs` (rows with
    `prompt`, `chosen`, `rejected`, optional `id`), evaluate it on `eval_pairs` and save it
    to `site.out_dir`, reporting `reward/...` metrics (`StageSite`: where it runs and reports).
    Raises `StageFailed` (after saving) when the held-out accuracy is below
    `cfg.min_eval_accuracy`, and `StageStopped` when asked to stop (`site.stop_requested`), after
    a checkpoint of its last step.
    """
    if len(train_pairs) == 0:
        raise ValueError("reward: the training set is empty (0 preference pairs)")
    if len(eval_pairs) == 0:
        raise ValueError("reward: the held-out set is empty (0 preference pairs); see rlhf_core.data.pairs.split_by_prompt")
    tokenizer = load_tokenizer(base_dir)
    train = _tokenize("training", train_pairs, tokenizer, cfg)
    evals = _tokenize("held-out", eval_pairs, tokenizer, cfg)
    if steps_per_epoch(len(train), cfg.global_batch_size) == 0:
        raise ValueError(
            f"reward: {len(train)} training pairs are fewer than one global batch of {cfg.global_batch_size} "
            f"(micro_batch_size {cfg.micro_batch_size} x num_workers {cfg.num_workers} x "
            f"grad_accum_steps {cfg.grad_accum_steps})"
        )

    weights = bootstrap_weights(len(train), cfg.ensemble_size, cfg.seed)
    run = fit_stage("reward", partial(_loop, cfg=cfg, base_dir=base_dir, out_dir=site.out_dir, train=train,
                                      evals=evals, weights=weights), _train_loop, cfg, site)
    summary = run.summary
    if summary.get("stopped") is not None:
        raise StageStopped("reward", summary["stopped"]["step"], summary["stopped"]["reason"], run.checkpoint_path)
    out = RewardTrainResult(
        path=Path(site.out_dir),
        eval_accuracy=summary["eval_accuracy"],
        eval_loss=summary["eval_loss"],
        reward_mean=summary["reward_mean"],
        reward_std=summary["reward_std"],
        steps=summary["steps"],
        final_loss=summary["final_loss"],
        truncated=train.truncated,
        run=run.record(),
        member_eval_accuracy=summary["member_eval_accuracy"],
    )
    if out.eval_accuracy < cfg.min_eval_accuracy:
        raise StageFailed(
            f"reward: held-out accuracy {out.eval_accuracy:.3f} is below reward.min_eval_accuracy={cfg.min_eval_accuracy}"
        )
    return out


@dataclass(frozen=True)
class RewardModels:
    """The reward stage's models: the one the policy trains against (one model or an
    ensemble) and the audit model it never sees (None when `reward.audit_share` is 0)."""

    proxy: RewardTrainResult
    audit: RewardTrainResult | None
    proxy_pairs: int  # training pairs (labels) of each
    audit_pairs: int


def train_reward_models(train_pairs: Pairs, eval_pairs: Pairs, base_dir: Path, cfg: RewardConfig,
                        site: StageSite) -> RewardModels:
    """`train_reward_model` for the proxy, then, when `cfg.audit_share` > 0, a plain reward
    model on the disjoint `audit_share` of the training prompts, saved inside the proxy's
    directory (`rlhf_core.models.reward.AUDIT_DIR`) so the two travel together. Both are
    judged on the same held-out pairs; the audit's metrics are reported as `reward_audit/*`."""
    audit_rows: Pairs = ()
    if cfg.audit_share > 0:
        train_pairs, audit_rows = split_by_prompt(train_pairs, cfg.audit_share, cfg.seed + 1)
    proxy = train_reward_model(train_pairs, eval_pairs, base_dir, cfg, site)
    audit = None
    if audit_rows:
        audit_cfg = cfg.model_copy(update={"ensemble_size": 1, "seed": cfg.seed + 1})
        audit_site = replace(site, out_dir=Path(site.out_dir) / AUDIT_DIR, run_name=f"{site.run_name}-audit",
                             on_metrics=_renamed(site.on_metrics, "reward/", "reward_audit/"))
        audit = train_reward_model(audit_rows, eval_pairs, base_dir, audit_cfg, audit_site)
    return RewardModels(proxy, audit, len(train_pairs), len(audit_rows))


def _renamed(on_metrics: MetricsCallback | None, old: str, new: str) -> MetricsCallback | None:
    if on_metrics is None:
        return None
    return partial(_call_renamed, on_metrics, old, new)


def _call_renamed(on_metrics: MetricsCallback, old: str, new: str, step: int, metrics: dict[str, float]) -> None:
    on_metrics(step, {new + k[len(old):] if k.startswith(old) else k: v for k, v in metrics.items()})


def _tokenize(which: str, rows, tokenizer, cfg: RewardConfig) -> TokenizedPairs:
    try:
        return tokenize_pairs(rows, tokenizer, cfg.max_length, cfg.on_overlength)
    except ValueError as exc:  # OverlengthError: say which set, keep the type
        raise type(exc)(f"reward ({which} pairs): {exc}") from None


@dataclass(frozen=True)
class RewardWorkerInputs:
    """What every worker of a reward run is given (it crosses the Ray boundary: it pickles)."""

    runtime: StageRuntime
    cfg: RewardConfig
    base_dir: str  # the SFT policy the reward model starts from
    out_dir: str
    train: Any  # TokenizedPairs, shared by the driver (`train_context.share`: Ray's object store)
    evals: Any  # TokenizedPairs, shared alike
    weights: torch.Tensor | None = None  # (N, K) bootstrap weights of the ensemble's members; None: one model


def _loop(runtime: StageRuntime, *, cfg, base_dir, out_dir, train, evals, weights) -> RewardWorkerInputs:
    """Called once the cluster is joined: the pairs go to its object store (`train_context.share`)."""
    return RewardWorkerInputs(runtime, cfg, str(Path(base_dir).resolve()), str(Path(out_dir).resolve()),
                      train_context.share(train), train_context.share(evals), weights)


def bootstrap_weights(num_pairs: int, members: int, seed: int) -> torch.Tensor | None:
    """(N, K) Poisson(1) counts: how often member k sees pair n in each epoch (the online
    bootstrap), drawn once from `seed`, so a resumed run trains on the same resamples.
    None for one member: a single reward model sees every pair once."""
    if members == 1:
        return None
    g = torch.Generator().manual_seed(seed)
    return torch.poisson(torch.ones(num_pairs, members), generator=g)

# ----------------------------------------------------------------------------- worker


def _train_loop(loop: RewardWorkerInputs) -> dict[str, Any] | None:
    cfg, runtime = loop.cfg, loop.runtime
    worker = start_worker(runtime, cfg.seed)
    rank, world = worker.rank, worker.world
    precision = agreed_precision("reward", cfg.precision, runtime.use_gpu, worker)
    train: TokenizedPairs = train_context.fetch(loop.train)

    per_rank_batch = cfg.micro_batch_size * cfg.grad_accum_steps
    steps_epoch = steps_per_epoch(len(train), cfg.global_batch_size)
    total_steps = steps_epoch * cfg.epochs
    model = freeze_lower_layers(reward_model_from_base(loop.base_dir, seed=cfg.seed, num_members=cfg.ensemble_size),
                                cfg.frozen_layers)
    engine, *_ = worker.deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=deepspeed_engine.deepspeed_config(
            train_batch_size=cfg.global_batch_size, micro_batch_size=cfg.micro_batch_size,
            grad_accum_steps=cfg.grad_accum_steps, max_grad_norm=cfg.max_grad_norm, zero_stage=cfg.zero_stage,
            learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay, use_gpu=runtime.use_gpu),
        lr_scheduler=partial(warmup_cosine_lr, total=total_steps, warmup=cfg.warmup_steps),
    )

    pos, stopped = run_epochs(
        engine, stage="reward", engine_tag=ENGINE_TAG, runtime=runtime, rank=rank, world=world, seed=cfg.seed,
        num_rows=len(train), per_rank_batch=per_rank_batch, steps_epoch=steps_epoch, total_steps=total_steps,
        checkpoint_every=cfg.checkpoint_every,
        step_fn=lambda indices, meter: _optimizer_step(engine, train, indices, cfg, meter, loop.weights, precision),
        metrics_fn=lambda gathered: _step_metrics(gathered, engine, cfg, train.truncated),
    )

    if stopped is not None:  # asked to stop: the step's checkpoint is saved, the model is not
        return {"stopped": {"step": pos.global_step, "reason": stopped}} if rank == 0 else None
    state_dict = full_fp32_parameters(engine, rank)
    if rank != 0:
        return None
    device = evaluation_device(engine.device, 4 * sum(t.numel() for t in state_dict.values()), "reward")
    return _evaluate_and_save(state_dict, engine.module.config, loop, pos, precision, device)


def _optimizer_step(
    engine, pairs: TokenizedPairs, indices: list[int], cfg: RewardConfig, meter: WorkerMeter,
    weights: torch.Tensor | None = None, precision: Precision = "fp32",
) -> tuple[list[float], float]:
    """One optimizer step over `grad_accum_steps` micro-batches of this rank's `indices`
    (each ensemble member's pairs weighted by its bootstrap `weights`, (N, K)), the forward
    passes in `precision` (the loss in fp32).

    -> ([loss, accuracy, margin, chosen mean, rejected mean, grad norm] averaged over the
    micro-batches, seconds). DeepSpeed steps the optimizer at the accumulation boundary.
    """
    start = time.perf_counter()
    sums = np.zeros(5)
    mb = cfg.micro_batch_size
    grad_norm = float("nan")
    for k in range(cfg.grad_accum_steps):
        micro = indices[k * mb : (k + 1) * mb]
        batch = collate_pairs(pairs, micro)
        w = weights[micro].to(engine.device) if weights is not None else None  # (B, K)
        with meter.compute():  # the forward pass: this worker's own compute, no collectives
            with computing_in(precision, engine.device):
                rewards = engine(
                    input_ids=batch.input_ids.to(engine.device), attention_mask=batch.attention_mask.to(engine.device)
                ).logits.float()  # (2B, K)
            loss, m = ensemble_bradley_terry_loss(rewards[: batch.num_pairs], rewards[batch.num_pairs :], w, cfg.margin)
        engine.backward(loss)
        if cfg.zero_stage == 0 and engine.is_gradient_accumulation_boundary():
            grad_norm = module_grad_norm(engine.module)  # without ZeRO DeepSpeed does not keep it
        engine.step()
        sums += [loss.item(), m["accuracy"], m["reward_margin"], m["chosen_reward"], m["rejected_reward"]]
    if cfg.zero_stage > 0:
        norm = engine.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else float("nan")
    return [*(sums / cfg.grad_accum_steps).tolist(), grad_norm], time.perf_counter() - start


STEP_FIGURES = ("loss", "accuracy", "margin", "chosen_mean", "rejected_mean")  # a rank's step, then its grad norm


def _step_metrics(gathered: list[RankStep], engine, cfg: RewardConfig, truncated: int) -> dict[str, float]:
    """Flat `reward/*` metrics of one step from every rank's figures (STEP_FIGURES, grad norm)."""
    local = np.array([g.figures for g in gathered])  # (world, len(STEP_FIGURES) + 1)
    mean = local.mean(axis=0)
    times = [g.seconds for g in gathered]
    metrics = {f"reward/{name}": mean[i] for i, name in enumerate(STEP_FIGURES)}
    metrics |= {
        "reward/grad_norm": local[0, -1],  # global norm, the same on every rank
        "reward/lr": engine.get_lr()[0],
        "reward/pairs_per_s": cfg.global_batch_size / max(times),
        "reward/truncated": truncated,
    }
    metrics.update({f"reward/step_time_s/worker_{r}": t for r, t in enumerate(times)})
    return {k: float(v) for k, v in metrics.items()}


def _evaluate_and_save(
    state_dict: dict[str, torch.Tensor], model_config, loop: RewardWorkerInputs, pos: DataPosition,
    precision: Precision, device: torch.device,
) -> dict[str, Any]:
    """Rank 0, on the stage's `device`: held-out accuracy and loss, normalisation stats (in fp32:
    the figures the gates and the policy's normalisation read), HF save. -> the run summary."""
    model = AutoModelForSequenceClassification.from_config(model_config, dtype=torch.float32)
    model.load_state_dict(state_dict, strict=True)
    model.to(device)
    cfg = loop.cfg
    evals: TokenizedPairs = train_context.fetch(loop.evals)
    members_chosen, members_rejected = score_pairs_members(model, evals)  # (K, N) each
    r_chosen, r_rejected = member_mean(members_chosen), member_mean(members_rejected)
    eval_loss, eval_metrics = bradley_terry_loss(r_chosen, r_rejected)
    stats = reward_stats(torch.cat([r_chosen, r_rejected]))
    members = [reward_stats(torch.cat([c, r])) for c, r in zip(members_chosen, members_rejected)]
    final_loss = pos.history[-1]["reward/loss"] if pos.history else math.nan
    meta = {
        "base_model": loop.base_dir,
        "eval_accuracy": eval_metrics["accuracy"],
        "eval_loss": eval_loss.item(),
        "eval_pairs": len(evals),
        "steps": pos.global_step,
        "final_loss": final_loss,
        "zero_stage": cfg.zero_stage,
        "num_workers": cfg.num_workers,
        "max_length": cfg.max_length,
        "precision": precision,  # what the training passes computed in
        "ensemble_size": cfg.ensemble_size,
        "member_stats": [[m.mean, m.std] for m in members],
        "member_eval_accuracy": (members_chosen > members_rejected).float().mean(1).tolist(),
    }
    save_reward_model(model.cpu(), load_tokenizer(loop.base_dir), Path(loop.out_dir), stats, extra=meta,
                      dtype=deepspeed_engine.saved_dtype(loop.runtime.use_gpu))
    return {
        **meta,
        "reward_mean": stats.mean,
        "reward_std": stats.std,
        "consumed": pos.consumed,
        "history": pos.history,
    }
