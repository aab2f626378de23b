"""The epoch loop of every stage that trains on a fixed set of rows (the reward model's pairs,
DPO's pairs, KTO's labelled answers), written once; each stage supplies its optimizer step and
how a step's figures are gathered into metrics.

    resume (or start) ─► per epoch: this rank's shuffled share of the rows (`rank_step_indices`)
      └► per step: step_fn(indices) ─► all-gather every rank's figures ─► metrics_fn
           ─► advance the data position ─► emit (rank 0) ─► injected kill ─► checkpoint
           (also of a step after which the stage is asked to stop: it then ends there)

A checkpoint holds the engine and the data position (epoch, step in epoch, rows seen), so a
restarted worker resumes at the next step with the same shuffles.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any, NamedTuple

import torch.distributed as dist

from rlhf_core.data.pairs import DataPosition, rank_step_indices
from rlhf_core.distributed.checkpoint import report_checkpoint, resume_latest
from rlhf_core.distributed.fault_injection import fault_point, worker_point
from rlhf_core.distributed.stage import StageRuntime, record_attempt
from rlhf_core.distributed.worker_meter import WorkerMeter, flatten_workers

class RankStep(NamedTuple):
    """What each rank hands the others after a step (the all-gather)."""

    seconds: float
    indices: list[int]  # the rows it trained on
    figures: list[float]  # its step_fn's figures
    worker: dict[str, Any]  # its WorkerMeter's figures


# step_fn(this rank's indices, meter) -> (this rank's figures, seconds)
StepFn = Callable[[list[int], WorkerMeter], tuple[list[float], float]]
# metrics_fn(every rank's RankStep) -> the step's metrics
MetricsFn = Callable[[list[RankStep]], dict[str, float]]


def run_epochs(
    engine, *, stage: str, engine_tag: str, runtime: StageRuntime, rank: int, world: int, seed: int,
    num_rows: int, per_rank_batch: int, steps_epoch: int, total_steps: int, checkpoint_every: int,
    step_fn: StepFn, metrics_fn: MetricsFn,
) -> tuple[DataPosition, str | None]:
    """Train `engine` from its last checkpoint of `stage` (or from the start) to `total_steps`,
    or until the stage is asked to stop (`StageRuntime.agreed_stop`, between steps, after a
    checkpoint of the step) -> (the data position at the end, why it stopped early or None).
    Every rank calls it (collectives)."""
    saved = resume_latest(stage, {engine_tag: engine}, rank, world)
    pos = DataPosition(**saved) if saved is not None else DataPosition()
    record_attempt(runtime, rank, pos.global_step if saved is not None else None)

    plan, plan_epoch = [], None
    meter = WorkerMeter(runtime.use_gpu)
    while pos.global_step < total_steps:
        if plan_epoch != pos.epoch:
            plan, plan_epoch = rank_step_indices(num_rows, seed, pos.epoch, rank, world, per_rank_batch), pos.epoch
        indices = plan[pos.step_in_epoch]
        meter.start()
        local, step_time = step_fn(indices, meter)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, RankStep(step_time, indices, local, meter.figures(len(indices))))
        metrics = metrics_fn(gathered)
        pos.advance(steps_epoch, [i for g in gathered for i in g.indices], metrics)
        if rank == 0:
            runtime.emit(pos.global_step, metrics | flatten_workers([g.worker for g in gathered]))
        fault_point(worker_point(runtime.stage, pos.global_step, rank))
        stop = runtime.agreed_stop(rank) if pos.global_step < total_steps else None
        if stop is not None or pos.global_step % checkpoint_every == 0 or pos.global_step == total_steps:
            # the only ray.train.report: see rlhf_core.distributed.stage
            report_checkpoint(stage, pos.global_step, {engine_tag: engine}, asdict(pos), metrics, rank, world)
        if stop is not None:
            return pos, stop
    return pos, None
