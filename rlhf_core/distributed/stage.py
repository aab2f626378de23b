"""The skeleton every Ray Train + DeepSpeed stage shares, on the driver and in the workers.

Driver, `fit_stage`: joins or starts a cluster, checks it can hold the workers, runs a
`TorchTrainer` whose workers restart from the last committed checkpoint up to `max_failures`
times, and reads back rank 0's summary and the attempts the workers recorded. The worker
function gets its settings as one typed, picklable object (bound with `functools.partial`),
not as Ray Train's untyped config dict.

Worker, `start_worker`: DeepSpeed imported on the right accelerator, Ray Train's process
group (gloo on CPU, NCCL on GPU) reused by DeepSpeed, the global RNGs seeded; then
`record_attempt` once the worker knows where it resumes from. A worker asks Ray Train for
nothing but through `train_context`, so the same loop also runs in one process without Ray
(`train_context.one_process`, how the GPU check drives the loops).

Ray Train V2 (the default in Ray 2.60) is assumed: `ray.train.report` is a barrier every
rank must reach, the training function's rank-0 return value comes back as
`Result.return_value`, and a second `fit()` with the same `storage_path` / `name` resumes
that run from its latest checkpoint instead of starting over. V2's controller takes one
report per worker per health-check poll (`RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`: 2 s by
default, 0.25 s on the local cluster the pipeline starts, `cluster.LOCAL_CLUSTER_ENV`) and
`report` blocks until the previous one is taken, so reporting every step would cap training
at one step per poll: only checkpoint steps are reported to Ray (each waits up to one poll
for its commit), per-step metrics go through the stage's picklable `on_metrics` on rank 0.

Memory (`memory_failure`): on a cluster that is this machine alone, a reward stage whose
estimate is more than the memory available at its start is refused before training; a stage
whose workers Ray's memory monitor kills fails with `StageOutOfMemory`, one block naming the
workers' memory, the machine's at the stage's start and the settings to change.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import psutil
import torch

from rlhf_core.distributed import train_context
from rlhf_core.distributed.collectives import host_group
from rlhf_core.distributed.deepspeed_engine import import_deepspeed
from rlhf_core.distributed.fault_injection import FAULT_ENV
from rlhf_core.distributed.memory_failure import StageOutOfMemory, raise_if_out_of_memory, refusal
from rlhf_core.models.gpu_room import GpuNeed, room_problem
from rlhf_core.models.memory import MachineMemory
from rlhf_core.rng import seed_everything
from rlhf_core.training.precision import resolve_precision
from rlhf_core.training.stage_types import MetricsCallback, StageSite, StopCheck

@dataclass(frozen=True)
class StageRuntime:
    """What every worker of a stage needs besides the stage's own settings."""

    stage: str  # "reward" | "policy": names the stage in messages and files
    use_gpu: bool
    attempts_file: str  # rank 0 appends one JSON line per attempt
    on_metrics: MetricsCallback | None  # runs on rank 0; must pickle
    stop_requested: StopCheck | None = None  # read on rank 0 between steps; must pickle
    gpu_need: GpuNeed | None = None  # checked by every rank on a GPU at its start (`start_worker`)

    def emit(self, step: int, metrics: dict[str, float]) -> None:
        if self.on_metrics is not None:
            self.on_metrics(step, metrics)

    def agreed_stop(self, rank: int) -> str | None:
        """Every rank (a collective when a stop check is set): why the stage is asked to stop, as
        rank 0 read it, else None. The same on every rank, so all stop after the same step."""
        if self.stop_requested is None:
            return None
        reason = [self.stop_requested() if rank == 0 else None]
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.broadcast_object_list(reason, src=0, group=host_group())
        return reason[0]

    @property
    def run_token(self) -> str:
        """A name of this stage's run: the same in every attempt of it (a restart resumes the run),
        another for another run on the cluster. For what an attempt names and the next one finds."""
        return hashlib.sha256(str(Path(self.attempts_file).parent.resolve()).encode()).hexdigest()[:8]


@dataclass(frozen=True)
class StageRecord:
    """How a training stage's run went, the same for every stage: its result's `run`."""

    attempts: int  # 1 + restarts after worker failures
    resumed_from_step: int | None  # checkpoint step the last attempt resumed from; None: never resumed
    seconds: float  # wall time of trainer.fit()
    checkpoint_path: str | None  # the last committed Ray Train checkpoint
    consumed: list[list[int]] = field(repr=False, default_factory=list)  # per step, the rows of all ranks
    metrics_history: list[dict[str, float]] = field(repr=False, default_factory=list)  # per step, as logged


@dataclass(frozen=True)
class StageRun:
    """What the driver reads back from a finished `fit()`."""

    summary: dict[str, Any]  # rank 0's return value
    attempts: int  # 1 + restarts after worker failures
    resumed_from_step: int | None  # checkpoint step the last attempt resumed from; None: never resumed
    seconds: float  # wall time of trainer.fit()
    checkpoint_path: str | None  # the last committed Ray Train checkpoint

    def record(self) -> StageRecord:
        """The stage's record: these facts, and the rows each step consumed and its logged metrics
        (rank 0's summary keys `consumed` and `history`)."""
        return StageRecord(self.attempts, self.resumed_from_step, self.seconds, self.checkpoint_path,
                           self.summary["consumed"], self.summary["history"])


class StageWorkers(Protocol):
    """How a stage's Ray Train workers are laid out (`RewardConfig` and `PolicyConfig` say it)."""

    num_workers: int
    use_gpu: bool | None  # None: GPUs when the cluster has them
    placement_strategy: str
    max_failures: int  # restarts from the last committed checkpoint before the stage fails


def fit_stage(
    stage: str,
    loop_for: Callable[[StageRuntime], Any],
    train_loop: Callable[[Any], dict[str, Any] | None],
    workers: StageWorkers,
    site: StageSite,
) -> StageRun:
    """Run `train_loop(loop_for(runtime))` on `workers.num_workers` Ray Train workers at `site`;
    the loop's settings are built once the cluster is known (`runtime.use_gpu`). A run name that
    already holds a run is resumed.

    Raises `StageOutOfMemory` when Ray's memory monitor killed the stage, or, for a loop whose
    `cfg` is a `RewardConfig` (its model in `base_dir`) on a cluster that is this machine, before
    training when the estimate is more than the machine has available.

    Inside `train_context.one_process` the loop runs in this process instead, without Ray."""
    if (here := train_context.in_one_process()) is not None:
        return _fit_here(here, stage, loop_for, train_loop, site)
    from rlhf_core.distributed.cluster import (  # noqa: PLC0415 - the driver's alone: a worker loop needs no Ray
        check_cluster, check_engine_room, connect_ray, shutdown_ray, torch_trainer,
    )

    started_ray = connect_ray()
    try:
        num_workers = workers.num_workers
        gpu = check_cluster(stage, num_workers, workers.use_gpu)
        run_dir = Path(site.storage_path).resolve() / site.run_name
        run_dir.mkdir(parents=True, exist_ok=True)
        attempts_file = run_dir / f"{stage}_attempts.jsonl"
        loop = loop_for(StageRuntime(stage, gpu, str(attempts_file), site.on_metrics, site.stop_requested,
                                          site.gpu_need))
        rollout = getattr(getattr(loop, "cfg", None), "rollout", None)
        if rollout is not None and rollout.placement == "separate":
            check_engine_room(stage, num_workers, gpu, rollout.num_engines, rollout.tensor_parallel_size)
        vm = psutil.virtual_memory()
        machine = MachineMemory(vm.total, vm.available)  # at the stage's start, for the failure block
        cfg = getattr(loop, "cfg", None)
        if _cluster_is_this_machine() and (refused := refusal(stage, cfg, getattr(loop, "base_dir", None), machine)):
            raise StageOutOfMemory(refused)
        trainer = torch_trainer(
            partial(train_loop, loop), num_workers=num_workers, use_gpu=gpu,
            placement_strategy=workers.placement_strategy, run_name=site.run_name, storage_path=site.storage_path,
            max_failures=workers.max_failures,
            # DeepSpeed picks its accelerator when first imported; without GPUs it must be "cpu".
            # A test's fault ($RLHF_FAULT) reaches the workers of a cluster started before it was set.
            env={**({} if gpu else {"DS_ACCELERATOR": "cpu"}),
                 **({FAULT_ENV: os.environ[FAULT_ENV]} if os.environ.get(FAULT_ENV) else {})},
        )
        start = time.perf_counter()
        try:
            result = trainer.fit()
        except Exception as exc:
            raise_if_out_of_memory(stage, exc, machine, cfg)
            raise
        seconds = time.perf_counter() - start
    finally:
        if started_ray:
            shutdown_ray()

    summary = getattr(result, "return_value", None)
    if summary is None:
        raise RuntimeError(f"{stage}: rank 0 returned no summary (Ray Train V2 is required: RAY_TRAIN_V2_ENABLED=1)")
    return _stage_run(summary, attempts_file, seconds, result.checkpoint.path if result.checkpoint is not None else None)


def _stage_run(summary: dict[str, Any], attempts_file: Path, seconds: float, checkpoint: str | None) -> StageRun:
    attempts = [json.loads(line) for line in attempts_file.read_text().splitlines() if line.strip()]
    return StageRun(summary=summary, attempts=len(attempts), seconds=seconds, checkpoint_path=checkpoint,
                    resumed_from_step=attempts[-1]["resumed_from_step"] if attempts else None)


def _fit_here(here: train_context.OneProcess, stage: str, loop_for: Callable[[StageRuntime], Any],
              train_loop: Callable[[Any], dict[str, Any] | None], site: StageSite) -> StageRun:
    """`fit_stage` in this process: the loop as rank 0 of a world of one (`train_context.one_process`);
    its checkpoints and attempts in the world's storage, under `site.run_name`: a run of that name
    that holds a checkpoint is resumed."""
    with here.running(site.run_name) as run_dir:
        attempts_file = run_dir / f"{stage}_attempts.jsonl"
        loop = loop_for(StageRuntime(stage, here.use_gpu, str(attempts_file), site.on_metrics, site.stop_requested,
                                     site.gpu_need))
        start = time.perf_counter()
        summary = train_loop(loop)
        committed = here.committed()
    return _stage_run(summary, attempts_file, time.perf_counter() - start, str(committed[-1]) if committed else None)


def _cluster_is_this_machine() -> bool:
    """Whether the Ray cluster is one node on this machine: then this machine's memory is the workers'."""
    import ray  # noqa: PLC0415

    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        return len(nodes) == 1 and nodes[0].get("NodeManagerAddress") == ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - a client that cannot list the nodes: skip the check, not the stage
        return False


@dataclass(frozen=True)
class Worker:
    """This worker's DeepSpeed module and place in the group."""

    deepspeed: Any
    rank: int
    world: int


def cpu_threads(local_workers: int, cores: int | None = None) -> int:
    """Intra-op threads of one of `local_workers` CPU workers on a node of `cores` cores (the
    ones this process may run on). Ray gives a worker one CPU and OMP_NUM_THREADS=1: a stage
    of one worker on a 2-core machine left a core idle (a 135M reward model: 0.9 pairs/s)."""
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, cores // max(1, local_workers))


def start_worker(runtime: StageRuntime, seed: int, torch_threads: int | None = None) -> Worker:
    """DeepSpeed on this worker's accelerator over Ray Train's process group, and the global
    RNGs seeded with `seed`. On CPU torch's intra-op threads are `torch_threads`, by default
    the node's cores shared among its workers (`cpu_threads`)."""
    rank, world, local_world = train_context.place()
    if runtime.use_gpu:  # this worker's GPU (Ray Train assigns one per worker) is where DeepSpeed and NCCL work
        torch.cuda.set_device(train_context.gpu())
        if runtime.gpu_need is not None:
            check_gpu_room(runtime.gpu_need, rank)
    deepspeed = import_deepspeed(runtime.use_gpu)
    deepspeed.utils.logger.setLevel(logging.WARNING)
    if not runtime.use_gpu:
        torch.set_num_threads(torch_threads or cpu_threads(local_world))
    deepspeed.init_distributed(dist_backend="nccl" if runtime.use_gpu else "gloo")  # wraps Ray Train's group
    seed_everything(seed)
    return Worker(deepspeed, rank, world)


def check_gpu_room(need: GpuNeed, rank: int) -> None:
    """Raise `StageOutOfMemory` when this rank's GPU has less free than `need` gives the rank
    (another process may hold part of it); before anything of the stage is loaded on it."""
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    gpu = f"{torch.cuda.get_device_name(device)}, cuda:{device} on {socket.gethostname()}"
    if (problem := room_problem(need, rank, free, total, gpu)) is not None:
        raise StageOutOfMemory(problem)


def evaluation_device(device: torch.device, model_bytes: int, stage: str) -> torch.device:
    """Where a stage's held-out pass runs: the stage's own `device`, unless that is a GPU with
    less memory free than the pass's fp32 models need (`model_bytes`, with a quarter more for
    activations): then the CPU, said in the log. The trainer's cached blocks are handed back first."""
    if device.type != "cuda":
        return device
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    if free >= 1.25 * model_bytes:
        return device
    print(f"{stage}: the held-out pass needs about {model_bytes / 2**30:.1f} GiB, {free / 2**30:.1f} GiB are free "
          f"on {device}: it runs on the CPU", flush=True)
    return torch.device("cpu")


def agreed_precision(stage: str, requested: str, use_gpu: bool, worker: Worker) -> str:
    """`<stage>.precision` resolved on rank 0 (auto measures there) and given to every rank, so
    that no two ranks compute in different precisions. A resumed attempt resolves it again."""
    chosen = [resolve_precision(requested, use_gpu) if worker.rank == 0 else None]
    if worker.world > 1:
        torch.distributed.broadcast_object_list(chosen, src=0)
    if worker.rank == 0:
        print(f"{stage}: computing in {chosen[0]} ({stage}.precision: {requested})", flush=True)
    return chosen[0]


def record_attempt(runtime: StageRuntime, rank: int, resumed_from: int | None) -> None:
    """Rank 0: one line per attempt, read back by `fit_stage`."""
    if rank == 0:
        with open(runtime.attempts_file, "a") as f:
            f.write(json.dumps({"resumed_from_step": resumed_from, "unix_time": time.time()}) + "\n")
