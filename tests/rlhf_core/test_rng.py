"""Saving and restoring the global RNGs: a restored process draws what it would have drawn;
derived seeds are stable and distinct."""
import random

import numpy as np
import pytest
import torch

from rlhf_core.rng import derive_seed, rng_state, seed_everything, set_rng_state


def draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_restored_state_repeats_the_draws_of_every_generator():
    seed_everything(3)
    state = rng_state()
    first = draws()
    seed_everything(4)  # what vLLM's engine core does while it starts in this process
    assert draws() != first
    set_rng_state(state)
    assert draws() == first


def test_seed_everything_seeds_all_three():
    seed_everything(11)
    a = draws()
    seed_everything(11)
    assert draws() == a


def test_derived_seeds_are_the_trainers_formulas():
    # pinned: a change here changes every policy run's rollouts and minibatch order
    assert derive_seed(0, 1) == 1
    assert derive_seed(3, 7) == 3 * 1_000_003 + 7
    assert derive_seed(3, 7, rank=1, world=2) == 3 * 1_000_003 + 7 * 2 + 1
    assert derive_seed(3, 7, chunk=2) == (3 * 1_000_003 + 7) * 1_000 + 2


def test_derived_seeds_do_not_collide_within_a_run():
    steps, world, chunks = range(1, 200), 4, 8
    ranks = {derive_seed(5, s, rank=r, world=world) for s in steps for r in range(world)}
    assert len(ranks) == len(steps) * world
    per_chunk = {derive_seed(5, s, chunk=k) for s in steps for k in range(chunks)}
    assert len(per_chunk) == len(steps) * chunks
    with pytest.raises(ValueError, match="rank 2 outside a world of 2"):
        derive_seed(5, 1, rank=2, world=2)
