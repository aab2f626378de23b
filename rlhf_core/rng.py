"""The process's global random number generators (python, numpy, torch and, where present,
CUDA): seed them, and save and restore their state. Training stages checkpoint this state so
that a resumed run draws what the uninterrupted run would have; the rollout engine restores
it after vLLM reseeds them while starting in the trainer's process. `derive_seed` gives each
draw of a run (a step's rollouts, a rank's minibatch shuffle, a chunk of a pipelined step)
its own seed from the run's one configured seed."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


STEP_STRIDE = 1_000_003  # a prime above any step x world count: runs of different seeds never share a seed
CHUNK_STRIDE = 1_000  # more generate calls per step than a pipelined step ever makes


def derive_seed(seed: int, step: int, *, rank: int = 0, world: int = 1, chunk: int | None = None) -> int:
    """The seed of one draw of RL step `step` (1-based) in a run seeded with `seed`:
    seed * STEP_STRIDE + step * world + rank, and for chunk k of a step that times
    CHUNK_STRIDE plus k. Distinct (step, rank) pairs, and distinct chunks of a step, get distinct
    seeds; a draw's seed depends on nothing else, so a resumed run draws what the uninterrupted
    one did."""
    if not 0 <= rank < world:
        raise ValueError(f"derive_seed: rank {rank} outside a world of {world}")
    base = seed * STEP_STRIDE + step * world + rank
    return base if chunk is None else base * CHUNK_STRIDE + chunk


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
