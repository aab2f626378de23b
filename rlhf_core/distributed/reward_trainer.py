"""Reward-model training (Bradley-Terry) on Ray Train + DeepSpeed, resumable after a lost worker.

Driver, `train_reward_model`: checks the input (empty sets, overlength pairs under "reject",
fewer pairs than one global batch, more workers than the Ray cluster has CPUs/GPUs) before
anything starts, puts the tokenized pairs in the object store and runs a `TorchTrainer`.
Ray Train's process group (gloo on CPU, NCCL on GPU) is reused by DeepSpeed.

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

A checkpoint is one directory, the files of all ranks merged by Ray Train:

    engine/             DeepSpeed `save_checkpoint(tag="engine")`: module + ZeRO optimizer
                        shards of every rank (zero_pp_rank_<r>_...), lr scheduler
    latest, zero_to_fp32.py, zero_to_torch.py   written by DeepSpeed (rank 0)
    rng_rank_<r>.pt      python / numpy / torch RNG state of rank r
    trainer_state.json   (rank 0) next data position, per-step consumed pair indices and
                        metrics history of every committed step, world size

Ray Train V2 (the default in Ray 2.60) is assumed: `ray.train.report` is a barrier every
rank must reach, the training function's rank-0 return value comes back as
`Result.return_value`, and a second `fit()` with the same `storage_path` / `name`
resumes that run from its latest checkpoint instead of starting over. V2's controller takes
one report per worker per health-check poll (`RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`: 2 s by
default, 0.25 s on the local cluster the pipeline starts, `cluster.LOCAL_CLUSTER_ENV`) and
`report` blocks until the previous one is taken, so reporting every step would cap training
at one step per poll: only checkpoint steps are reported to Ray (each waits up to one poll
for its commit), per-step metrics go through `on_metrics`.
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.train
import torch
import torch.distributed as dist
from transformers import AutoModelForSequenceClassification

from rlhf_core.algos.losses import bradley_terry_loss
from rlhf_core.config import RewardConfig
from rlhf_core.distributed.cluster import check_cluster, connect_ray, import_deepspeed, torch_trainer
from rlhf_core.distributed.worker_meter import WorkerMeter, flatten_workers
from rlhf_core.data.pairs import TokenizedPairs, collate_pairs, rank_step_indices, steps_per_epoch, tokenize_pairs
from rlhf_core.models.reward import reward_model_from_base, reward_stats, save_reward_model, score_pairs
from rlhf_core.rng import rng_state, seed_everything, set_rng_state
from rlhf_core.tokenizer import load_tokenizer
from rlhf_core.training.base_policy import StageFailed
from rlhf_core.training.sft import MetricsCallback, warmup_cosine

ENGINE_TAG = "engine"
STATE_FILE = "trainer_state.json"
ATTEMPTS_FILE = "reward_attempts.jsonl"


@dataclass(frozen=True)
class KillWorkerOnce:
    """Test hook: the worker of `rank` SIGKILLs itself right after optimizer step `at_step`,
    unless `marker` exists (it creates it first, so the retried worker lives)."""

    rank: int
    at_step: int
    marker: Path


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
    seconds: float  # wall time of trainer.fit()
    attempts: int  # 1 + restarts after worker failures
    resumed_from_step: int | None  # checkpoint step the last attempt resumed from; None: never resumed
    checkpoint_path: str | None  # the last committed Ray Train checkpoint
    consumed: list[list[int]] = field(repr=False, default_factory=list)  # per step, pair indices of all ranks
    metrics_history: list[dict[str, float]] = field(repr=False, default_factory=list)


def deepspeed_config(cfg: RewardConfig, use_gpu: bool) -> dict[str, Any]:
    """The DeepSpeed config of a reward run: ZeRO `cfg.zero_stage`, AdamW, clipping;
    bf16 on GPU, fp32 on CPU (with torch's AdamW: DeepSpeed's fused Adam is CUDA only).

    The learning-rate schedule is passed to `deepspeed.initialize` as a callable instead
    (`_lr_schedule`): DeepSpeed's WarmupLR / WarmupCosineLR give the first step lr 0.
    """
    return {
        "train_batch_size": cfg.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum_steps,
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": {"stage": cfg.zero_stage},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": cfg.learning_rate,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": cfg.weight_decay,
                "torch_adam": not use_gpu,
            },
        },
        "bf16": {"enabled": use_gpu},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _lr_schedule(optimizer: torch.optim.Optimizer, total: int, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then cosine decay to 10%, as SFT (`rlhf_core.training.sft.warmup_cosine`)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, total, max(warmup, 1)))


# ----------------------------------------------------------------------------- driver


def train_reward_model(
    train_pairs: Sequence[Mapping[str, Any]],
    eval_pairs: Sequence[Mapping[str, Any]],
    base_dir: Path,
    cfg: RewardConfig,
    out_dir: Path,
    storage_path: Path,
    on_metrics: MetricsCallback | None = None,
    run_name: str = "reward",
    *,
    _kill_once: KillWorkerOnce | None = None,
) -> RewardTrainResult:
    """Train a reward model from the SFT policy in `base_dir` on `train_pairs` (rows with
    `prompt`, `chosen`, `rejected`, optional `id`), evaluate it on `eval_pairs` and save it
    to `out_dir`. Ray Train keeps runs and checkpoints under `storage_path / run_name`; a
    run name that already holds a run is resumed, so give each pipeline run its own.

    `on_metrics(step, {"reward/...": value})` is called on the rank-0 worker, so it must
    pickle (e.g. `monitoring.sink.MlflowMetricsSink`). Steps redone after a restart are
    reported again. Raises `StageFailed` (after saving) when the held-out accuracy is below
    `cfg.min_eval_accuracy`.
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

    started_ray = connect_ray()
    try:
        use_gpu = check_cluster("reward", cfg.num_workers, cfg.use_gpu)
        run_dir = Path(storage_path).resolve() / run_name
        run_dir.mkdir(parents=True, exist_ok=True)
        loop_config = {
            "cfg": cfg.model_dump(mode="json"),
            "use_gpu": use_gpu,
            "base_dir": str(Path(base_dir).resolve()),
            "out_dir": str(Path(out_dir).resolve()),
            "train": ray.put(train),
            "eval": ray.put(evals),
            "on_metrics": on_metrics,
            "attempts_file": str(run_dir / ATTEMPTS_FILE),
            "kill_once": _kill_once,
        }
        trainer = torch_trainer(
            _train_loop, loop_config, num_workers=cfg.num_workers, use_gpu=use_gpu,
            placement_strategy=cfg.placement_strategy, run_name=run_name, storage_path=storage_path,
            max_failures=cfg.max_failures,
            # DeepSpeed picks its accelerator when first imported; without GPUs it must be "cpu".
            env={} if use_gpu else {"DS_ACCELERATOR": "cpu"},
        )
        start = time.perf_counter()
        result = trainer.fit()
        seconds = time.perf_counter() - start
    finally:
        if started_ray:
            ray.shutdown()

    summary = getattr(result, "return_value", None)
    if summary is None:
        raise RuntimeError("reward: rank 0 returned no summary (Ray Train V2 is required: RAY_TRAIN_V2_ENABLED=1)")
    attempts = [json.loads(line) for line in (run_dir / ATTEMPTS_FILE).read_text().splitlines() if line.strip()]
    out = RewardTrainResult(
        path=Path(out_dir),
        eval_accuracy=summary["eval_accuracy"],
        eval_loss=summary["eval_loss"],
        reward_mean=summary["reward_mean"],
        reward_std=summary["reward_std"],
        steps=summary["steps"],
        final_loss=summary["final_loss"],
        truncated=train.truncated,
        seconds=seconds,
        attempts=len(attempts),
        resumed_from_step=attempts[-1]["resumed_from_step"] if attempts else None,
        checkpoint_path=result.checkpoint.path if result.checkpoint is not None else None,
        consumed=summary["consumed"],
        metrics_history=summary["history"],
    )
    if out.eval_accuracy < cfg.min_eval_accuracy:
        raise StageFailed(
            f"reward: held-out accuracy {out.eval_accuracy:.3f} is below reward.min_eval_accuracy={cfg.min_eval_accuracy}"
        )
    return out


def _tokenize(which: str, rows, tokenizer, cfg: RewardConfig) -> TokenizedPairs:
    try:
        return tokenize_pairs(rows, tokenizer, cfg.max_length, cfg.on_overlength)
    except ValueError as exc:  # OverlengthError: say which set, keep the type
        raise type(exc)(f"reward ({which} pairs): {exc}") from None






# ----------------------------------------------------------------------------- worker


@dataclass
class _Position:
    """Where training stands: the next (epoch, step in epoch) and what committed steps did."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    consumed: list[list[int]] = field(default_factory=list)
    history: list[dict[str, float]] = field(default_factory=list)

    def advance(self, steps_in_epoch: int, consumed: list[int], metrics: dict[str, float]) -> None:
        self.global_step += 1
        self.step_in_epoch += 1
        if self.step_in_epoch == steps_in_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        self.consumed.append(consumed)
        self.history.append({"step": self.global_step, **metrics})


def _train_loop(config: dict[str, Any]) -> dict[str, Any] | None:
    cfg = RewardConfig.model_validate(config["cfg"])
    use_gpu = config["use_gpu"]
    deepspeed = import_deepspeed(use_gpu)

    deepspeed.utils.logger.setLevel(logging.WARNING)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    deepspeed.init_distributed(dist_backend="nccl" if use_gpu else "gloo")  # wraps Ray Train's process group
    train: TokenizedPairs = ray.get(config["train"])

    per_rank_batch = cfg.micro_batch_size * cfg.grad_accum_steps
    steps_epoch = steps_per_epoch(len(train), cfg.global_batch_size)
    total_steps = steps_epoch * cfg.epochs
    seed_everything(cfg.seed)
    model = reward_model_from_base(config["base_dir"], seed=cfg.seed)
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=deepspeed_config(cfg, use_gpu),
        lr_scheduler=partial(_lr_schedule, total=total_steps, warmup=cfg.warmup_steps),
    )

    pos, resumed_from = _Position(), None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as ckpt_dir:
            pos = _load_checkpoint(engine, Path(ckpt_dir), rank, world)
        resumed_from = pos.global_step
    if rank == 0:
        with open(config["attempts_file"], "a") as f:
            f.write(json.dumps({"resumed_from_step": resumed_from, "unix_time": time.time()}) + "\n")

    on_metrics: MetricsCallback | None = config["on_metrics"]
    kill: KillWorkerOnce | None = config["kill_once"]
    plan, plan_epoch = [], None
    meter = WorkerMeter(use_gpu)
    while pos.global_step < total_steps:
        if plan_epoch != pos.epoch:
            plan, plan_epoch = rank_step_indices(len(train), cfg.seed, pos.epoch, rank, world, per_rank_batch), pos.epoch
        indices = plan[pos.step_in_epoch]
        meter.start()
        local, step_time = _optimizer_step(engine, train, indices, cfg, meter)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (step_time, indices, local, meter.figures(len(indices))))
        metrics = _step_metrics(gathered, engine, cfg, train.truncated)
        pos.advance(steps_epoch, [i for _, idx, _, _ in gathered for i in idx], metrics)
        if rank == 0 and on_metrics is not None:
            on_metrics(pos.global_step, metrics | flatten_workers([g[3] for g in gathered]))
        if kill is not None and kill.rank == rank and kill.at_step == pos.global_step and not kill.marker.exists():
            kill.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        if pos.global_step % cfg.checkpoint_every == 0 or pos.global_step == total_steps:
            _report_checkpoint(engine, pos, metrics, rank, world)  # the only ray.train.report: see module doc

    state_dict = _full_fp32_state_dict(engine, rank)
    if rank != 0:
        return None
    return _evaluate_and_save(state_dict, engine.module.config, config, cfg, pos)




def _optimizer_step(
    engine, pairs: TokenizedPairs, indices: list[int], cfg: RewardConfig, meter: WorkerMeter
) -> tuple[list[float], float]:
    """One optimizer step over `grad_accum_steps` micro-batches of this rank's `indices`.

    -> ([loss, accuracy, margin, chosen mean, rejected mean, grad norm] averaged over the
    micro-batches, seconds). DeepSpeed steps the optimizer at the accumulation boundary.
    """
    start = time.perf_counter()
    sums = np.zeros(5)
    mb = cfg.micro_batch_size
    grad_norm = float("nan")
    for k in range(cfg.grad_accum_steps):
        batch = collate_pairs(pairs, indices[k * mb : (k + 1) * mb])
        with meter.compute():  # the forward pass: this worker's own compute, no collectives
            rewards = engine(
                input_ids=batch.input_ids.to(engine.device), attention_mask=batch.attention_mask.to(engine.device)
            ).logits[:, 0].float()  # (2B,)
            loss, m = bradley_terry_loss(rewards[: batch.num_pairs], rewards[batch.num_pairs :], cfg.margin)
        engine.backward(loss)
        if cfg.zero_stage == 0 and engine.is_gradient_accumulation_boundary():
            grad_norm = _grad_norm(engine.module)  # without ZeRO DeepSpeed does not keep it
        engine.step()
        sums += [loss.item(), m["accuracy"], m["reward_margin"], m["chosen_reward"], m["rejected_reward"]]
    if cfg.zero_stage > 0:
        norm = engine.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else float("nan")
    return [*(sums / cfg.grad_accum_steps).tolist(), grad_norm], time.perf_counter() - start


def _grad_norm(module: torch.nn.Module) -> float:
    norms = [p.grad.detach().float().norm() for p in module.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)).item() if norms else float("nan")


def _step_metrics(gathered: list[Any], engine, cfg: RewardConfig, truncated: int) -> dict[str, float]:
    """Flat `reward/*` metrics of one step from every rank's (step time, indices, local metrics)."""
    local = np.array([g[2] for g in gathered])  # (world, 6)
    mean = local.mean(axis=0)
    times = [g[0] for g in gathered]
    metrics = {
        "reward/loss": mean[0],
        "reward/accuracy": mean[1],
        "reward/margin": mean[2],
        "reward/chosen_mean": mean[3],
        "reward/rejected_mean": mean[4],
        "reward/grad_norm": local[0, 5],  # global norm, the same on every rank
        "reward/lr": engine.get_lr()[0],
        "reward/pairs_per_s": cfg.global_batch_size / max(times),
        "reward/truncated": truncated,
    }
    metrics.update({f"reward/step_time_s/worker_{r}": t for r, t in enumerate(times)})
    return {k: float(v) for k, v in metrics.items()}






def _report_checkpoint(engine, pos: _Position, metrics: dict[str, float], rank: int, world: int) -> None:
    """Every rank saves its part into its own temp dir; Ray Train merges them into one checkpoint.

    Returns once the controller has committed it: a reported checkpoint sits in a queue until
    the controller's next poll, and a worker dying before that would lose it silently.
    """
    with tempfile.TemporaryDirectory(prefix="reward-ckpt-") as tmp:
        engine.save_checkpoint(tmp, tag=ENGINE_TAG)
        torch.save(rng_state(), Path(tmp) / f"rng_rank_{rank}.pt")
        if rank == 0:
            state = {
                "world_size": world,
                "epoch": pos.epoch,
                "step_in_epoch": pos.step_in_epoch,
                "global_step": pos.global_step,
                "consumed": pos.consumed,
                "history": pos.history,
            }
            (Path(tmp) / STATE_FILE).write_text(json.dumps(state))
        ray.train.report(
            metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp), delete_local_checkpoint_after_upload=False
        )
    if rank == 0:
        ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)


def _load_checkpoint(engine, ckpt_dir: Path, rank: int, world: int) -> _Position:
    state = json.loads((ckpt_dir / STATE_FILE).read_text())
    if state["world_size"] != world:
        raise ValueError(
            f"reward: checkpoint {ckpt_dir} was written by {state['world_size']} workers, this run has {world}; "
            "ZeRO shards cannot be re-split"
        )
    load_path, _ = engine.load_checkpoint(str(ckpt_dir), tag=ENGINE_TAG)
    if load_path is None:
        raise RuntimeError(f"reward: DeepSpeed found no engine checkpoint in {ckpt_dir}")
    set_rng_state(torch.load(ckpt_dir / f"rng_rank_{rank}.pt", weights_only=False))
    return _Position(state["epoch"], state["step_in_epoch"], state["global_step"], state["consumed"], state["history"])


def _full_fp32_state_dict(engine, rank: int) -> dict[str, torch.Tensor] | None:
    """The full fp32 parameters on rank 0 (None elsewhere). Every rank must call it: under
    ZeRO each parameter is assembled from the optimizer's fp32 partitions by a collective."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, param in engine.module.named_parameters():
        full = safe_get_full_fp32_param(param)  # None without ZeRO: the module holds it whole
        if full is None:
            full = param.detach()
        if rank == 0:
            out[name] = full.detach().float().cpu().clone()
    return out if rank == 0 else None


def _evaluate_and_save(
    state_dict: dict[str, torch.Tensor], model_config, config: dict[str, Any], cfg: RewardConfig, pos: _Position
) -> dict[str, Any]:
    """Rank 0: held-out accuracy and loss, normalisation stats, HF save. -> the run summary."""
    model = AutoModelForSequenceClassification.from_config(model_config, dtype=torch.float32)
    model.load_state_dict(state_dict, strict=True)
    evals: TokenizedPairs = ray.get(config["eval"])
    r_chosen, r_rejected = score_pairs(model, evals)
    eval_loss, eval_metrics = bradley_terry_loss(r_chosen, r_rejected)
    stats = reward_stats(torch.cat([r_chosen, r_rejected]))
    final_loss = pos.history[-1]["reward/loss"] if pos.history else math.nan
    meta = {
        "base_model": config["base_dir"],
        "eval_accuracy": eval_metrics["accuracy"],
        "eval_loss": eval_loss.item(),
        "eval_pairs": len(evals),
        "steps": pos.global_step,
        "final_loss": final_loss,
        "zero_stage": cfg.zero_stage,
        "num_workers": cfg.num_workers,
        "max_length": cfg.max_length,
    }
    save_reward_model(model, load_tokenizer(config["base_dir"]), Path(config["out_dir"]), stats, extra=meta)
    return {
        **meta,
        "reward_mean": stats.mean,
        "reward_std": stats.std,
        "consumed": pos.consumed,
        "history": pos.history,
    }
