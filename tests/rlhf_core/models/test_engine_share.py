"""The engine's share of a GPU sized from the run, against its closed form."""
from __future__ import annotations

import pytest

from rlhf_core.models.engine_share import (
    CPU_SHARE, GIB, MAX_SHARE, MIN_SHARE, OVERHEAD_BYTES, SEPARATE_SHARE, engine_share, kv_bytes_per_token, sized_share,
)


def test_the_kv_cache_per_token_is_k_and_v_of_every_layer():
    # Qwen2.5-0.5B in bf16: 24 layers, 2 KV heads of 64
    assert kv_bytes_per_token(24, 2, 64, 2) == 2 * 24 * 2 * 64 * 2 == 12_288


def test_the_sized_share_is_weights_plus_the_runs_kv_cache_plus_the_overhead():
    weights, kv, device = 1 * GIB, 12_288, 80 * GIB
    share = sized_share(weights, kv, 512, 1_500, device)
    assert share == pytest.approx((weights + 1.25 * kv * 512 * 1_500 + OVERHEAD_BYTES) / device)
    assert share < 0.2  # a sixth of what a fixed 0.5 gave this run
    assert sized_share(weights, kv, 512, 1_500, device, tensor_parallel_size=2) == pytest.approx(
        (weights / 2 + 1.25 * kv * 512 * 1_500 / 2 + OVERHEAD_BYTES) / device)
    assert sized_share(0, 0, 1, 1, 1_000 * GIB) == MIN_SHARE and sized_share(100 * GIB, 0, 1, 1, 80 * GIB) == MAX_SHARE
    with pytest.raises(ValueError, match="device memory"):
        sized_share(1, 1, 1, 1, 0)


def test_a_configured_share_wins_and_null_depends_on_where_the_engine_runs():
    sized = lambda: 0.17  # noqa: E731
    assert engine_share(0.4, on_gpu=True, separate=False, sized=sized) == 0.4
    assert engine_share(None, on_gpu=True, separate=False, sized=sized) == 0.17
    assert engine_share(None, on_gpu=True, separate=True, sized=sized) == SEPARATE_SHARE
    assert engine_share(None, on_gpu=False, separate=False, sized=sized) == CPU_SHARE
