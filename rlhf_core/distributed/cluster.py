"""What every Ray Train stage needs: a cluster to run on, what a SIGTERM does while it is up, and
its size checked before training. (DeepSpeed's import: `deepspeed_engine`; seeding and RNG
state: `rlhf_core.rng`.)"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import ray
import torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy

from rlhf_core.distributed.rendezvous import LoopbackTorchConfig


# Ray Train's defaults suit large clusters. On the one node we start ourselves (the embedded
# default) the Train controller polls its workers every 0.25 s, not every 2 s: each committed
# checkpoint, and each run's start and end, waits for a poll. And there is no preemption
# watcher, an actor process of its own that watches for cloud nodes being reclaimed
# (docs/performance-notes.md, "Training stages"). Settings made outside win.
LOCAL_CLUSTER_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}

log = logging.getLogger(__name__)


def connect_ray() -> bool:
    """Use the cluster this process is connected to, else join $RAY_ADDRESS, else start a
    local one (never attaching to another local cluster by accident) with LOCAL_CLUSTER_ENV.
    True if we started it.

    Ray's core worker installs a C++ failure handler for SIGTERM that ends the process on the
    spot, leaving Prefect's temporary server and Ray's own agents running without a parent: it
    is turned off (`RAY_DISABLE_FAILURE_SIGNAL_HANDLER`) so that `ray_session`'s handler runs."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
        return False
    for key, value in LOCAL_CLUSTER_ENV.items():  # read by Ray Train in this process, at each fit()
        os.environ.setdefault(key, value)
    # Workers' own logs stay in the session's log directory (/tmp/ray/session_latest/logs):
    # echoed, Ray Train's per-report lines bury the pipeline's output. A worker failure
    # still surfaces as the exception trainer.fit() raises.
    protect_ray_token()  # before Ray writes a new token: its directory is ours alone
    start_local_ray(log_to_driver=False)
    protect_ray_token()
    return True


def start_local_ray(**init_kwargs) -> None:
    """Start a one-node cluster that listens on loopback only, and connect to it.

    Ray's servers (GCS, raylet, every worker's gRPC server, the runtime-env agent, the
    autoscaler monitor's unauthenticated /metrics) bind 127.0.0.1 when the node's address is
    127.0.0.1, and every interface otherwise. On Linux `ray.init` turns a node address of
    127.0.0.1 into the machine's reachable one unless Ray treats the machine as it does a
    laptop (macOS, Windows: `ray_constants.ENABLE_RAY_CLUSTER` off, the node is loopback).
    We do that for the start of our own cluster only: nothing joins a cluster we start, and
    `ray start` for real clusters reads the setting in its own process.

    Ray starts idle Python workers for the first driver by default (one per CPU of the node,
    two on a 2-core machine), ready for plain tasks. The work here runs in actors (Train
    controllers and workers, rollout engines) whose environment differs from the job's, so
    those workers were never used (their cost: docs/performance-notes.md, Orchestration). They
    are not started; a task that needs a worker gets one when it asks."""
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
                 _system_config={"prestart_worker_first_driver": False}, **init_kwargs)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def protect_ray_token(directory: Path | None = None) -> None:
    """Ray keeps the token of its clusters in ~/.ray/auth_token, written with the umask's mode
    (0644: readable by every user of the machine). Keep the directory 0700 and the file 0600."""
    directory = directory or Path.home() / ".ray"
    directory.mkdir(mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    token = directory / "auth_token"
    if token.exists():
        os.chmod(token, 0o600)


@contextmanager
def ray_session():
    """`connect_ray` for a block of stages: they share the cluster, and one we started is
    shut down at the end of the block (not after each stage). A SIGTERM meanwhile ends the
    process through `_stop_on_sigterm`."""
    started = connect_ray()
    previous = _stop_on_sigterm()
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if started:
            shutdown_ray()


def _stop_on_sigterm():
    """From the main thread: on SIGTERM disconnect from Ray (stopping a cluster this process
    started, its agents and workers), run the exit handlers (Prefect's temporary server stops)
    and exit with 143. A stage runs in a task thread that a Ray call can hold for minutes, and
    Prefect's own handler waits for that thread, so the exit cannot wait for it either.
    -> the handler it replaced, None where no handler can be set (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum: int, frame) -> None:
        print(f"rlhf: stopped by {signal.Signals(signum).name} in a Ray stage: stopping Ray and exiting",
              file=sys.stderr, flush=True)
        shutdown_ray()
        atexit._run_exitfuncs()  # noqa: SLF001 - what a normal exit runs: Prefect's server stops, Ray's and MLflow's hooks
        os._exit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


def shutdown_ray() -> None:
    """`ray.shutdown()`; for a cluster this process started, then `end_orphans` of its raylet.

    Ray's workers and actors are meant to exit when their raylet does. One that misses it (a
    Train controller in a futex wait was seen to) would run on without a parent, holding its
    memory, until someone kills it."""
    raylet = _own_raylet()
    ray.shutdown()
    if raylet is not None:
        end_orphans(*raylet)


def _own_raylet() -> tuple[int, float] | None:
    """(pid, start time) of the raylet this process started; None where it joined a cluster."""
    from ray._private import ray_constants

    node = getattr(ray._private.worker, "_global_node", None)  # noqa: SLF001 - no public handle on the raylet
    try:
        [info] = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET]
        return info.process.pid, psutil.Process(info.process.pid).create_time()
    except (AttributeError, KeyError, ValueError, psutil.Error):
        return None


def end_orphans(raylet_pid: int, since: float, grace_s: float = 2.0) -> list[str]:
    """End the processes started for the raylet `raylet_pid` (Ray puts RAY_RAYLET_PID in its
    workers' environment, and their children inherit it) since `since` that are still running:
    `grace_s` to leave on their own, then SIGTERM, then SIGKILL. -> "pid name" of each ended."""
    ours = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    left = []
    for proc in psutil.process_iter():
        try:
            if (proc.pid not in ours and proc.create_time() >= since
                    and proc.environ().get("RAY_RAYLET_PID") == str(raylet_pid)):
                left.append(proc)
        except psutil.Error:  # gone, a zombie, or another user's
            continue
    if left:
        _, left = psutil.wait_procs(left, timeout=grace_s)
    ended = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in left:
            try:
                name = proc.name()
                proc.send_signal(sig)
            except psutil.Error:
                continue
            if sig == signal.SIGTERM:
                ended.append(f"{proc.pid} {name}")
        if left:
            _, left = psutil.wait_procs(left, timeout=grace_s)
    if ended:
        log.warning("Ray: ended %d process(es) that outlived the local cluster: %s", len(ended), ", ".join(ended))
    return ended


def check_cluster(stage: str, num_workers: int, use_gpu: bool | None) -> bool:
    """Whether to use GPUs (None: when the cluster has them and torch can drive them); raises,
    naming the config key, if the cluster cannot hold `num_workers` workers or GPUs are asked
    for where torch cannot use them."""
    resources = ray.cluster_resources()
    cpus, gpus = int(resources.get("CPU", 0)), int(resources.get("GPU", 0))
    why_not = cuda_unusable(local_only=len(ray.nodes()) == 1)
    if use_gpu is None:
        gpu = gpus > 0 and why_not is None
        if gpus > 0 and why_not is not None:
            print(f"{stage}: the Ray cluster has {gpus} GPUs but training runs on CPUs: {why_not} "
                  f"(set {stage}.use_gpu: false to say so, or install a CUDA build of torch)", flush=True)
    else:
        gpu = use_gpu
        if gpu and why_not is not None:
            raise ValueError(f"{stage}.use_gpu is true but {why_not}")
    if gpu and num_workers > gpus:
        raise ValueError(f"{stage}.num_workers={num_workers} but the Ray cluster has {gpus} GPUs")
    if num_workers > cpus:
        raise ValueError(f"{stage}.num_workers={num_workers} but the Ray cluster has {cpus} CPUs")
    return gpu


def engine_bundles(tensor_parallel_size: int, use_gpu: bool) -> list[dict[str, float]]:
    """The placement group of one engine: a GPU and a CPU per tensor-parallel rank, or on CPU one
    bundle of that many CPUs (vLLM's CPU workers of one engine share its node's cores)."""
    if use_gpu:
        return [{"GPU": 1.0, "CPU": 1.0} for _ in range(tensor_parallel_size)]
    return [{"CPU": float(tensor_parallel_size)}]


def engines_resources(num_engines: int, tensor_parallel_size: int, use_gpu: bool) -> dict[str, float]:
    """What `num_engines` engines take from the cluster, summed over their bundles."""
    total: dict[str, float] = {}
    for bundle in engine_bundles(tensor_parallel_size, use_gpu) * num_engines:
        for key, value in bundle.items():
            total[key] = total.get(key, 0.0) + value
    return total


def check_engine_room(stage: str, num_workers: int, use_gpu: bool, num_engines: int, tensor_parallel_size: int,
                      resources: dict[str, float] | None = None) -> None:
    """With rollout engines of their own (`policy.rollout.placement: separate`): raises, naming the
    settings, if the cluster cannot hold the trainer's workers and the engines together (an
    engine's placement group would otherwise wait for room that never comes)."""
    resources = ray.cluster_resources() if resources is None else resources
    need = engines_resources(num_engines, tensor_parallel_size, use_gpu)
    need["CPU"] = need.get("CPU", 0.0) + num_workers
    if use_gpu:
        need["GPU"] = need.get("GPU", 0.0) + num_workers
    short = {k: (v, resources.get(k, 0.0)) for k, v in need.items() if v > resources.get(k, 0.0)}
    if short:
        have = ", ".join(f"{k} {need_:g} needed, {has:g} in the cluster" for k, (need_, has) in short.items())
        raise ValueError(f"{stage}.num_workers={num_workers} with policy.rollout.num_engines={num_engines} of "
                         f"tensor_parallel_size={tensor_parallel_size} (placement: separate): {have}; lower one of them "
                         "or add nodes")


def cuda_unusable(local_only: bool) -> str | None:
    """Why torch here cannot train on GPUs, or None. A CPU build of torch (`make setup` on a
    machine without GPUs) cannot, whatever the hardware: Ray still counts the GPUs through
    NVML and NCCL would fail on the first collective. On a one-node cluster (this machine) the
    driver's torch must also see a device; the workers of a multi-node cluster are checked by
    their own torch, not this process's."""
    if not torch.backends.cuda.is_built():
        return f"this torch ({torch.__version__}) is a CPU build"
    if local_only and not torch.cuda.is_available():
        return "torch.cuda.is_available() is false on this machine (driver, CUDA_VISIBLE_DEVICES?)"
    return None


class StageTrainer(TorchTrainer):
    """Ray Train's TorchTrainer, less what Ray Train 2.60 starts in every fit that does nothing
    here (each an actor process of its own that imports Ray Train and Ray Data):

    - the dataset manager, when no Ray Dataset is passed (the stages hand their data over in the
      object store, not as Ray Datasets). The workers take no dataset shard provider then (Ray
      Train's own default).

    And on a cluster this process started, which ends with it (`shutdown_ray`):

    - the placement-group cleaner, which removes the workers' placement group should the Train
      controller die without removing it, for a driver that goes on using a cluster that
      outlives it. A controller that dies fails its stage, and with it the run, whose process
      then ends with the cluster and its placement groups. Each fit waits for its cleaner to
      start;
    - the autoscaling coordinator (one a cluster) and the controller's resource requests to it
      (`LocalScalingPolicy`): they ask Ray's autoscaler for nodes, and a cluster we started has
      none. The first fit on a cluster waits for the coordinator to start.

    `bench/fit_helpers.py` measures what they cost. On a cluster we joined ($RAY_ADDRESS) the
    cleaner and the coordinator stay. tests/rlhf_core/distributed/test_cluster.py fails if a Ray
    upgrade moves what this relies on (a patch: `rlhf_core.patches`)."""

    def _create_default_callbacks(self) -> list:
        left_out = () if self.datasets else (DatasetsCallback,)
        if _own_raylet() is not None:
            left_out += (PlacementGroupCleanerCallback,)
        return [c for c in super()._create_default_callbacks() if not isinstance(c, left_out)]

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        if _own_raylet() is not None and type(controller_init_kwargs.get("scaling_policy")) is FixedScalingPolicy:
            controller_init_kwargs["scaling_policy"] = LocalScalingPolicy(self.scaling_config)
        return super()._initialize_and_run_controller(**controller_init_kwargs)


class LocalScalingPolicy(FixedScalingPolicy):
    """Ray Train's fixed-size scaling policy without its resource requests to the autoscaling
    coordinator: for a cluster without an autoscaler (`StageTrainer`)."""

    def after_controller_start(self, train_run_context) -> None:
        """Ray Train's registers a requester and sends its first request here: nothing to do."""

    def _maybe_send_resource_request(self) -> None:
        """Nothing to ask for (the policy's decisions call this on every poll)."""


def torch_trainer(
    train_fn: Callable[[], Any], *, num_workers: int, use_gpu: bool, placement_strategy: str,
    run_name: str, storage_path, max_failures: int, env: dict[str, str],
) -> StageTrainer:
    """The Ray Train set-up every stage shares: `train_fn()` (its settings bound to it, not in
    Ray Train's config dict) on `num_workers` workers placed by `placement_strategy`, runs and
    checkpoints under `storage_path/run_name` (the last two checkpoints kept), `max_failures`
    restarts from the last checkpoint, `env` in every worker's environment, and the torch
    process group on loopback when the workers share a node (`rendezvous`)."""
    return StageTrainer(
        train_loop_per_worker=train_fn,
        torch_config=LoopbackTorchConfig(),  # the rendezvous store on loopback when workers share a node
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu, placement_strategy=placement_strategy),
        run_config=RunConfig(
            name=run_name,
            storage_path=str(Path(storage_path).resolve()),
            failure_config=FailureConfig(max_failures=max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            worker_runtime_env={"env_vars": env} if env else {},
        ),
    )
