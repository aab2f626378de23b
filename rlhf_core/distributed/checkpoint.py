"""A training stage's checkpoint: DeepSpeed engines, every rank's RNG state and
rank 0's trainer state, saved by every rank into its own directory and merged by Ray Train
(or committed by `train_context.one_process`) into one:

    <tag>/               DeepSpeed `save_checkpoint(tag=...)` per engine: module + ZeRO
                         optimizer shards of every rank (zero_pp_rank_<r>_...), lr scheduler;
                         the module's trainable parameters only when some are frozen (LoRA:
                         the adapters; the frozen base is the one the stage starts from)
    latest, zero_to_fp32.py, zero_to_torch.py   written by DeepSpeed (rank 0)
    rng_rank_<r>.pt      python / numpy / torch RNG state of rank r
    trainer_state.json   (rank 0) the stage's own state and the world size that wrote it

Only checkpoint steps report to Ray Train (`train_context.report`; see `rlhf_core.distributed.stage`).
"""
from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rlhf_core.distributed import train_context
from rlhf_core.distributed.fault_injection import fault_point, worker_point
from rlhf_core.rng import rng_state, set_rng_state

STATE_FILE = "trainer_state.json"


def report_checkpoint(
    stage: str, step: int, engines: Mapping[str, Any], state: Mapping[str, Any] | None, metrics: dict[str, float],
    rank: int, world: int,
) -> None:
    """Save this rank's part of step `step`'s checkpoint (`engines` by tag, None engines
    skipped; `state` on rank 0) and report it with `metrics`. Returns once the controller has
    committed it: a reported checkpoint sits in a queue until the controller's next poll, and a
    worker dying before that would lose it silently. A checkpoint some rank never reported is
    never committed, so a worker that dies while writing leaves the last committed one as the
    one a restart loads."""
    with tempfile.TemporaryDirectory(prefix=f"{stage}-ckpt-") as tmp:
        for tag, engine in engines.items():
            if engine is not None:
                engine.save_checkpoint(tmp, tag=tag, **_frozen_excluded(engine))
        fault_point(worker_point(f"{stage}:writing", step, rank))  # a test kills here: shards written, unreported
        torch.save(rng_state(), Path(tmp) / f"rng_rank_{rank}.pt")
        if rank == 0:
            (Path(tmp) / STATE_FILE).write_text(json.dumps({"world_size": world, **state}))
        train_context.report(metrics, Path(tmp), step, rank)
    fault_point(f"{stage}:checkpoint")


def _frozen_excluded(engine: Any) -> dict[str, bool]:
    """`exclude_frozen_parameters` for a DeepSpeed engine whose module has frozen parameters
    (LoRA's base weights: saving them would copy the whole model into every checkpoint); {}
    for any other engine."""
    module = getattr(engine, "module", None)
    if hasattr(engine, "zero_optimization") and any(not p.requires_grad for p in module.parameters()):
        return {"exclude_frozen_parameters": True}
    return {}


def resume_latest(stage: str, engines: Mapping[str, Any], rank: int, world: int) -> dict[str, Any] | None:
    """Load the run's latest committed checkpoint, if it has one, into `engines` and this rank's
    RNGs; -> the stage's state as saved (None: a fresh start)."""
    with train_context.latest_checkpoint() as ckpt_dir:
        return None if ckpt_dir is None else _load(stage, engines, ckpt_dir, rank, world)


def _load(stage: str, engines: Mapping[str, Any], ckpt_dir: Path, rank: int, world: int) -> dict[str, Any]:
    state = json.loads((ckpt_dir / STATE_FILE).read_text())
    written_by = state.pop("world_size")
    if written_by != world:
        raise ValueError(
            f"{stage}: checkpoint {ckpt_dir} was written by {written_by} workers, this run has {world}; "
            "ZeRO shards cannot be re-split"
        )
    for tag, engine in engines.items():
        if engine is not None:
            # what was left out is the frozen base, which the engine was built with
            partial = {"load_module_strict": False} if _frozen_excluded(engine) else {}
            load_path, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag, **partial)
            if load_path is None:
                raise RuntimeError(f"{stage}: DeepSpeed found no {tag} checkpoint in {ckpt_dir}")
    set_rng_state(torch.load(ckpt_dir / f"rng_rank_{rank}.pt", weights_only=False))
    return state
