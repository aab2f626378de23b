"""Offline optimisation of the policy on labels alone, on Ray Train + DeepSpeed, resumable
after a lost worker: `policy.algorithm: dpo` (DPO, or IPO) on preference pairs and
`policy.algorithm: kto` on unpaired answers labelled desirable or undesirable.

The policy starts from the SFT policy and learns from the labels directly
(`rlhf_core.algos.preference`) against the frozen SFT policy as reference: no rollouts, no
vLLM engine, no reward model. Each step's reference log-probs are computed alongside the
policy's (one extra forward pass without gradients) rather than stored.

Both methods score two sequences per row; the per-batch math (log-probs of the pairs, the
method's loss) is `rlhf_core.training.preference_step`.

Driver, `train_offline`: turns the rows into that form (for KTO, preference pairs are unpaired
first: `unpaired_examples`), tokenizes them (prompt, then response; `tokenize_policy_pairs`) and
checks them before anything starts, then runs the workers (`rlhf_core.distributed.stage`).

Worker, `_train_loop`: the same data-parallel plan and checkpoint as the reward stage
(`rlhf_core.data.pairs.rank_step_indices`, `DataPosition`): every optimizer step reads only
this rank's part of the epoch's shuffled order, and a restarted group resumes at exactly the
next batch. At the end rank 0 measures, on the held-out prompts, greedy exact-match accuracy
(before: the reference, which is the SFT policy) and the KL to the reference of sampled
answers, and saves the policy in Hugging Face format. The result is a `PolicyTrainResult`, so
evaluation, gates, registry and serving treat a DPO policy as any other.
"""
from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf_core.config import PolicyConfig
from rlhf_core.data.pairs import (
    DataPosition, steps_per_epoch, tokenize_policy_pairs, unpaired_examples, with_mismatched,
)
from rlhf_core.distributed import deepspeed_engine, train_context
from rlhf_core.distributed.deepspeed_engine import full_fp32_parameters, module_grad_norm, warmup_cosine_lr
from rlhf_core.distributed.epochs import RankStep, run_epochs
from rlhf_core.distributed.policy_trainer import PolicyTrainResult
from rlhf_core.distributed.stage import StageRuntime, evaluation_device, fit_stage, start_worker
from rlhf_core.distributed.worker_meter import WorkerMeter, peak_rss_gib
from rlhf_core.eval.accuracy import answer_accuracy, greedy_completions
from rlhf_core.eval.sampled_kl import EVAL_BATCH, sampled_kl
from rlhf_core.models.llama import load_policy, save_pretrained_atomic
from rlhf_core.models.lora import frozen_reference, load_policy_for_training, merged_policy
from rlhf_core.tokenizer import load_tokenizer
from rlhf_core.training.preference_step import FIGURES, Rows, offline_loss
from rlhf_core.training.stage_types import StageFailed, StageSite, StageStopped

ENGINE_TAG = "actor"


@dataclass(frozen=True)
class OfflineWorkerInputs:
    """What every worker of an offline run is given (it crosses the Ray boundary: it pickles)."""

    runtime: StageRuntime
    cfg: PolicyConfig
    sft_dir: str
    out_dir: str
    train: Any  # Rows, shared by the driver (`train_context.share`: Ray's object store)
    evals: Any  # the held-out Rows, or None, shared alike
    eval_prompts: tuple[str, ...]
    eval_answers: tuple[str, ...]
    answer_checker: str | None = None  # data.answer_checker: how accuracy judges an answer (None: exact text)


def train_offline(
    train_rows: Sequence[Mapping[str, Any]],
    eval_rows: Sequence[Mapping[str, Any]],
    eval_prompts: Sequence[str],
    eval_answers: Sequence[str],
    sft_dir: Path,
    cfg: PolicyConfig,
    site: StageSite,
    *,
    answer_checker: str | None = None,
) -> PolicyTrainResult:
    """Train the SFT policy in `sft_dir` with `cfg.algorithm` (dpo, kto) on `train_rows`, report
    the loss's figures on `eval_rows` and held-out accuracy on `eval_prompts` / `eval_answers`
    (no answers: none measured; judged by `answer_checker`, None: the exact text), and save the
    policy to `site.out_dir`, reporting `policy/...` metrics (`StageSite`: where it runs and reports).

    Rows are preference pairs (`prompt`, `chosen`, `rejected`, optional `id`); for KTO they may
    instead be labelled answers (`prompt`, `completion`, `desirable`), and pairs are unpaired
    first. Raises `StageFailed` (after saving) when the held-out accuracy gains less than
    `cfg.min_accuracy_gain`, and `StageStopped` when asked to stop (`site.stop_requested`), after
    a checkpoint of its last step.
    """
    if cfg.offline is None:
        raise ValueError(f"train_offline runs policy.algorithm dpo or kto, not {cfg.algorithm!r}")
    name = f"policy ({cfg.algorithm})"
    if len(train_rows) == 0:
        raise ValueError(f"{name}: the training set is empty (0 rows)")
    if eval_answers and len(eval_answers) != len(eval_prompts):
        raise ValueError(f"{name}: {len(eval_prompts)} held-out prompts but {len(eval_answers)} answers")
    tokenizer = load_tokenizer(sft_dir)
    train = _rows("training", train_rows, tokenizer, cfg)
    evals = _rows("held-out", eval_rows, tokenizer, cfg) if len(eval_rows) else None
    batch = cfg.offline.batch_size
    if steps_per_epoch(len(train), batch) == 0:
        raise ValueError(f"{name}: {len(train)} training rows are fewer than one batch of "
                         f"{cfg.algorithm}.batch_size={batch}")

    def loop_for(runtime: StageRuntime) -> OfflineWorkerInputs:
        return OfflineWorkerInputs(runtime, cfg, str(Path(sft_dir).resolve()), str(Path(site.out_dir).resolve()),
                                   train_context.share(train), train_context.share(evals), tuple(eval_prompts),
                                   tuple(eval_answers), answer_checker)

    run = fit_stage("policy", loop_for, _train_loop, cfg, site)
    s = run.summary
    if s.get("stopped") is not None:
        raise StageStopped("policy", s["stopped"]["step"], s["stopped"]["reason"], run.checkpoint_path)
    result = PolicyTrainResult(
        path=Path(site.out_dir), algorithm=method_name(cfg),
        accuracy_before=s["accuracy_before"], accuracy_after=s["accuracy_after"],
        kl_final=s["kl"], kl_max=s["kl"], kl_bound=cfg.kl_bound, steps=s["global_step"], run=run.record(),
        evaluations=[{"step": s["global_step"], **s["held_out"]}],
        peak_memory=s["peak_memory"],
    )
    gain = result.accuracy_gain
    if gain is not None and gain < cfg.min_accuracy_gain:
        raise StageFailed(f"{name}: held-out accuracy gained {gain:+.3f}, less than "
                          f"policy.min_accuracy_gain={cfg.min_accuracy_gain}")
    return result


def method_name(cfg: PolicyConfig) -> str:
    """dpo, ipo or kto: what the result and the registry call the method."""
    if cfg.algorithm == "dpo":
        return "ipo" if cfg.dpo.loss_type == "ipo" else "dpo"
    return cfg.algorithm


def _rows(which: str, rows: Sequence[Mapping[str, Any]], tokenizer, cfg: PolicyConfig) -> Rows:
    desirable = None
    if cfg.algorithm == "kto":
        examples = rows if rows and "completion" in rows[0] else unpaired_examples(rows, cfg.kto.desirable_share,
                                                                                   cfg.seed)
        desirable = np.array([bool(e["desirable"]) for e in examples])
        rows = with_mismatched(examples, cfg.seed)
    try:
        pairs = tokenize_policy_pairs(rows, tokenizer, cfg.offline.max_length, cfg.offline.on_overlength)
    except ValueError as exc:  # OverlengthError: say which set and which setting, keep the type
        raise type(exc)(f"policy.{cfg.algorithm} ({which} rows): {exc}") from None
    return Rows(pairs, desirable)


# ----------------------------------------------------------------------------- worker


def _train_loop(loop: OfflineWorkerInputs) -> dict[str, Any] | None:
    cfg, d, runtime = loop.cfg, loop.cfg.offline, loop.runtime
    worker = start_worker(runtime, cfg.seed)
    rank, world = worker.rank, worker.world
    train: Rows = train_context.fetch(loop.train)

    accum = cfg.offline_grad_accum_steps
    per_rank_batch = d.micro_batch_size * accum
    steps_epoch = steps_per_epoch(len(train), d.batch_size)
    total_steps = steps_epoch * d.epochs
    model = load_policy_for_training(loop.sft_dir, cfg.lora, cfg.gradient_checkpointing)
    engine, *_ = worker.deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=deepspeed_engine.deepspeed_config(
            train_batch_size=d.batch_size, micro_batch_size=d.micro_batch_size, grad_accum_steps=accum,
            max_grad_norm=cfg.max_grad_norm, zero_stage=cfg.zero_stage, learning_rate=d.learning_rate,
            weight_decay=0.0, use_gpu=runtime.use_gpu),
        lr_scheduler=partial(warmup_cosine_lr, total=total_steps, warmup=d.warmup_steps),
    )
    reference = frozen_reference(loop.sft_dir, cfg.lora, engine.device)  # where the actor's log-probs are
    peaks = {"loaded": peak_rss_gib()}  # what the preflight's estimate of the stage is checked against
    figures = FIGURES[cfg.algorithm]
    pos, stopped = run_epochs(
        engine, stage="policy", engine_tag=ENGINE_TAG, runtime=runtime, rank=rank, world=world, seed=cfg.seed,
        num_rows=len(train), per_rank_batch=per_rank_batch, steps_epoch=steps_epoch, total_steps=total_steps,
        checkpoint_every=cfg.checkpoint_every,
        step_fn=lambda indices, meter: _optimizer_step(engine, reference, train, indices, cfg, meter, world),
        metrics_fn=lambda gathered: _step_metrics(gathered, engine, figures, d.batch_size, train.pairs.truncated),
    )

    if stopped is not None:  # asked to stop: the step's checkpoint is saved, the policy is not
        return {"stopped": {"step": pos.global_step, "reason": stopped}} if rank == 0 else None
    peaks["trained"] = peak_rss_gib()
    state_dict = full_fp32_parameters(engine, rank)
    if rank != 0:
        return None
    fp32_bytes = 4 * sum(t.numel() for t in state_dict.values())  # the policy and a reference beside it
    summary = _evaluate_and_save(state_dict, reference, loop, pos, evaluation_device(engine.device, 2 * fp32_bytes,
                                                                                      "policy"))
    peaks["evaluated"] = peak_rss_gib()
    print(f"policy ({cfg.algorithm}): rank 0's peak resident memory, GiB: {peaks}", flush=True)
    return {**summary, "peak_memory": peaks}


def _optimizer_step(engine, reference, rows: Rows, indices: list[int], cfg: PolicyConfig, meter: WorkerMeter,
                    world: int) -> tuple[list[float], float]:
    """One optimizer step over this rank's `indices` in micro-batches. -> (the method's
    `FIGURES` averaged over the micro-batches, then the grad norm; seconds)."""
    d = cfg.offline
    start = time.perf_counter()
    figures = FIGURES[cfg.algorithm]
    values = []
    grad_norm = math.nan
    for k in range(cfg.offline_grad_accum_steps):
        micro = indices[k * d.micro_batch_size : (k + 1) * d.micro_batch_size]
        with meter.compute():
            loss, m = offline_loss(engine, reference, rows, micro, cfg, world)
        engine.backward(loss)
        if cfg.zero_stage == 0 and engine.is_gradient_accumulation_boundary():
            grad_norm = module_grad_norm(engine.module)
        engine.step()
        values.append([m[f] for f in figures])
    if cfg.zero_stage > 0:
        norm = engine.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else math.nan
    return [*_nanmean(np.array(values)).tolist(), grad_norm], time.perf_counter() - start


def _nanmean(values: np.ndarray) -> np.ndarray:
    """Column means that skip NaN (a KTO micro-batch with no answer of one kind), NaN if all are."""
    counts = (~np.isnan(values)).sum(axis=0)
    return np.where(counts > 0, np.nansum(values, axis=0) / np.maximum(counts, 1), np.nan)


def _step_metrics(gathered: list[RankStep], engine, figures: tuple[str, ...], batch_size: int, truncated: int
                  ) -> dict[str, float]:
    """Flat `policy/*` metrics of one step from every rank's figures (`figures`, then its grad norm)."""
    local = np.array([g.figures for g in gathered])  # (world, len(figures) + 1)
    mean = _nanmean(local)
    times = [g.seconds for g in gathered]
    metrics = {f"policy/{name}": mean[i] for i, name in enumerate(figures)}
    metrics |= {
        "policy/grad_norm": local[0, -1],  # global norm, the same on every rank
        "policy/lr": engine.get_lr()[0],
        "policy/rows_per_s": batch_size / max(times),
        "policy/truncated": truncated,
    }
    metrics |= {f"policy/step_time_s/worker_{r}": t for r, t in enumerate(times)}
    return {k: float(v) for k, v in metrics.items()}


@torch.no_grad()
def _evaluate_and_save(state_dict: dict[str, torch.Tensor], reference, loop: OfflineWorkerInputs, pos: DataPosition,
                       device: torch.device) -> dict[str, Any]:
    """Rank 0, on the stage's `device`: held-out accuracy of the reference and the trained
    policy, the loss's figures on the held-out rows, the KL to the reference of sampled answers;
    the HF save. -> the summary."""
    cfg = loop.cfg
    model = merged_policy(loop.sft_dir, cfg.lora, state_dict).eval().to(device)  # fp32: the held-out figures exact
    if reference is None or reference.dtype != model.dtype or reference.device != model.device:
        # LoRA trained in place of a copy, or the frozen copy is bf16 on a GPU: at the end a copy
        # beside the model is cheap (no optimizer)
        reference = load_policy(loop.sft_dir).eval().to(device)
    tokenizer = load_tokenizer(loop.sft_dir)
    before = after = None
    if loop.eval_answers:
        prompts, answers = list(loop.eval_prompts), list(loop.eval_answers)
        before, after = (answer_accuracy(prompts, greedy_completions(m, tokenizer, prompts, cfg.max_new_tokens, EVAL_BATCH),
                                         answers, loop.answer_checker) for m in (reference, model))
    held_out: dict[str, float] = {}
    evals: Rows | None = train_context.fetch(loop.evals)
    if evals is not None:  # a micro-batch of rows a pass: all at once held every row's logits (GiBs at a 49k vocabulary)
        _, m = offline_loss(model, reference, evals, list(range(len(evals))), cfg, chunk=cfg.offline.micro_batch_size)
        held_out = {f"eval/{k}": v for k, v in m.items()}
    kl = sampled_kl(model, reference, tokenizer, list(loop.eval_prompts), cfg.max_new_tokens, cfg.temperature,
                    seed=cfg.seed)
    meta = {"stage": "policy", "algorithm": method_name(cfg), "base_model": loop.sft_dir, "reward_model": None,
            "lora": cfg.lora.model_dump() if cfg.lora.enabled else None,
            "steps": pos.global_step, "accuracy_before": before, "accuracy_after": after, "kl": kl,
            "kl_bound": cfg.kl_bound}
    save_pretrained_atomic(model.cpu(), tokenizer, Path(loop.out_dir), extra=meta,
                           dtype=deepspeed_engine.saved_dtype(loop.runtime.use_gpu))
    return {**asdict(pos), "accuracy_before": before, "accuracy_after": after, "kl": kl, "held_out": held_out}


