"""Saving and restoring the global RNGs: a restored process draws what it would have drawn."""
import random

import numpy as np
import torch

from rlhf_core.rng import rng_state, seed_everything, set_rng_state


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
