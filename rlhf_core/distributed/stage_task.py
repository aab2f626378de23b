"""Work of a stage that runs in one process (SFT, the gates' evaluation) as one Ray task with the
stage's resources: a GPU where the cluster has them (or the stage is told to use them), else
a CPU of a node with every core of it, as the driver had. One code path for both: the task
calls `fn(device, *args)` with the device it got.

On a cluster the task runs wherever Ray places it, so what it reads and writes must be on
storage every node sees (the run's `output_dir`, as for the training stages)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import psutil
import ray
import torch

from rlhf_core.distributed.cluster import check_cluster, connect_ray, shutdown_ray
from rlhf_core.distributed.memory_failure import raise_if_out_of_memory
from rlhf_core.models.memory import MachineMemory

T = TypeVar("T")


def _on_device(fn: Callable[..., T], gpu: bool, args: tuple, kwargs: dict) -> tuple[T, str]:
    """In the task: the device Ray gave it (its one visible GPU, else the CPU with the node's
    cores as intra-op threads) -> (fn's value, where it ran)."""
    from rlhf_core.distributed.stage import cpu_threads  # noqa: PLC0415 - the worker's own import

    if gpu:
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(cpu_threads(1))
        device = torch.device("cpu")
    return fn(device, *args, **kwargs), f"{device} of {ray.util.get_node_ip_address()}"


def run_stage_task(stage: str, fn: Callable[..., T], *args: Any, use_gpu: bool | None, settings: str,
                   **kwargs: Any) -> tuple[T, str]:
    """`fn(device, *args, **kwargs)` as one Ray task of `stage` on the cluster this process uses
    (else $RAY_ADDRESS's, else a local one it starts and stops) -> (its value, where it ran).
    `use_gpu` is the config section `settings`'s (named in its messages): None takes a GPU where
    the cluster has one. The task's own exception is raised here as it was raised there (its
    remote traceback chained); a task Ray's memory monitor killed raises `StageOutOfMemory`."""
    started = connect_ray()
    try:
        gpu = check_cluster(settings, 1, use_gpu)
        vm = psutil.virtual_memory()
        remote = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0, max_retries=0)(_on_device)
        try:
            return ray.get(remote.remote(fn, gpu, args, kwargs))
        except (ray.exceptions.RayTaskError, ray.exceptions.OutOfMemoryError) as exc:
            raise_if_out_of_memory(stage, exc, MachineMemory(vm.total, vm.available))
            if isinstance(exc, ray.exceptions.RayTaskError):
                raise exc.cause from exc
            raise
    finally:
        if started:
            shutdown_ray()
