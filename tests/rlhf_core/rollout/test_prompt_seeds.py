"""Each prompt of a seeded `generate` call gets a seed of its own; its n samples take seed + i."""
import pytest

from rlhf_core.rollout.vllm_engine import prompt_seeds

N = 8  # samples per prompt: a prompt's samples use seeds s, s + 1, ..., s + 7


def test_seeds_are_reproducible_and_depend_on_the_call_seed_and_the_position():
    assert prompt_seeds(3, 4) == prompt_seeds(3, 4)
    assert prompt_seeds(3, 4)[:2] == prompt_seeds(3, 2)  # a prompt's seed does not depend on the batch size
    assert prompt_seeds(3, 4) != prompt_seeds(4, 4)


def test_sample_seed_ranges_never_overlap_within_or_across_consecutive_calls():
    # what the trainer does: one call per step, seeds base + step
    starts = [s for step in range(50) for s in prompt_seeds(1_000_003 + step, 256)]
    ranges = sorted((s, s + N) for s in starts)
    assert all(hi <= next_lo for (_, hi), (next_lo, _) in zip(ranges, ranges[1:]))
    assert all(0 <= s < 2**62 for s in starts)


def test_negative_seed_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
        prompt_seeds(-1, 2)
