"""What a stage's worker asks of Ray Train, in one place: its rank and world, its device, the
checkpoint it resumes from, a checkpoint report that returns once the report is committed, and
the objects the driver shared with it. No worker loop imports Ray itself.

Two backends answer. Ray Train, for every stage the pipeline runs (`stage.fit_stage`'s
`TorchTrainer`). And `one_process`: the stage's worker loop in this very process, as rank 0 of
a world of one, over a process group it opens (NCCL on a GPU, gloo on the CPU, as Ray Train's
would be) and with checkpoints committed to a directory. A loop that dies there (a kill) is
resumed by running the stage again with the same directory, as Ray Train resumes a run of the
same name. That is how `make gpu-check` drives the real worker loops on a GPU machine that has
no Ray (`bench/gpu_loops.py`); it is no way to train at scale.

    with train_context.one_process(storage, use_gpu=True):
        train_reward_model(...)      # fit_stage runs the loop here, without Ray
"""
from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

COMMITTED = "checkpoint_"  # + the step, zero-padded: one directory per committed report


@dataclass
class OneProcess:
    """A world of one in this process: rank 0, its device, and where its runs' checkpoints are
    committed (`storage` / the run's name, `run_dir`, while a stage runs)."""

    storage: Path
    use_gpu: bool
    run_dir: Path | None = None

    def committed(self) -> list[Path]:
        """The running stage's committed checkpoints, oldest first."""
        return sorted(self.run_dir.glob(f"{COMMITTED}*[0-9]")) if self.run_dir is not None else []

    @contextmanager
    def running(self, run_name: str) -> Iterator[Path]:
        """While a stage of `run_name` runs: its directory, where its checkpoints are committed."""
        self.run_dir = self.storage / run_name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            yield self.run_dir
        finally:
            self.run_dir = None


_here: OneProcess | None = None


def in_one_process() -> OneProcess | None:
    """The world of one this process runs stages in (`one_process`), else None: Ray Train."""
    return _here


@contextmanager
def one_process(storage: Path, use_gpu: bool) -> Iterator[OneProcess]:
    """Stages started inside run their worker loop in this process (`stage.fit_stage`), their
    checkpoints committed under `storage`. Opens the default process group the loop's DeepSpeed
    joins, and closes it after."""
    global _here
    if _here is not None or torch.distributed.is_initialized():
        raise RuntimeError("one_process: this process already has a process group")
    storage = Path(storage)
    storage.mkdir(parents=True, exist_ok=True)
    if use_gpu:
        torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                      LOCAL_WORLD_SIZE="1")
    torch.distributed.init_process_group("nccl" if use_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=0, world_size=1, device_id=torch.device("cuda", 0) if use_gpu else None)
    _here = OneProcess(storage, use_gpu)
    try:
        yield _here
    finally:
        _here = None
        torch.distributed.destroy_process_group()


def share(obj: Any) -> Any:
    """On the driver: `obj` put where every worker reads it (Ray's object store; in one process, itself)."""
    if _here is not None:
        return obj
    import ray  # noqa: PLC0415

    return ray.put(obj)


def fetch(ref: Any) -> Any:
    """In a worker: what the driver `share`d."""
    if _here is not None:
        return ref
    import ray  # noqa: PLC0415

    return ray.get(ref)


def place() -> tuple[int, int, int]:
    """(world rank, world size, workers on this node)."""
    if _here is not None:
        return 0, 1, 1
    import ray.train  # noqa: PLC0415

    ctx = ray.train.get_context()
    return ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_world_size()


def gpu() -> torch.device:
    """The GPU Ray Train gave this worker."""
    if _here is not None:
        return torch.device("cuda", 0)
    from ray.train.torch import get_device  # noqa: PLC0415

    return get_device()


@contextmanager
def latest_checkpoint() -> Iterator[Path | None]:
    """The directory of the run's latest committed checkpoint while the block runs; None for a fresh run."""
    if _here is not None:
        committed = _here.committed()
        yield committed[-1] if committed else None
        return
    import ray.train  # noqa: PLC0415

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        yield None
        return
    with checkpoint.as_directory() as directory:
        yield Path(directory)


def report(metrics: dict[str, float], directory: Path, step: int, rank: int) -> None:
    """Every rank: its part of step `step`'s checkpoint, in `directory`, reported with `metrics`.
    Returns once the checkpoint is committed (Ray Train: rank 0 waits for the controller's commit;
    one process: the directory is copied and renamed into place)."""
    if _here is not None:
        final = _here.run_dir / f"{COMMITTED}{step:08d}"
        partial = final.with_name(final.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(directory, partial)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)  # a kill before this line leaves the last committed one the latest
        return
    import ray.train  # noqa: PLC0415

    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(directory)),
                     delete_local_checkpoint_after_upload=False)
    if rank == 0:
        ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
