"""A tiny base policy to build reward models from (the Ray cluster is in tests/conftest.py)."""
from __future__ import annotations

import random

import pytest

from rlhf_core.config import ModelConfig
from rlhf_core.data.synthetic import answer_for, has_carry, near_miss, prompt_for, sum_without_carry
from rlhf_core.models.llama import build_policy, save_pretrained_atomic
from rlhf_core.tokenizer import train_tokenizer

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2)


def arithmetic_pairs(n: int, seed: int = 0) -> list[dict]:
    """Demo pairs over two-digit problems (`07+48=` -> chosen `055`): the rejected answer is
    the no-carry sum when the problem carries, else a near miss (±1, ±10)."""
    rng = random.Random(seed)
    problems = [(a, b) for a in range(100) for b in range(100)]
    rng.shuffle(problems)
    rows = []
    for i, (a, b) in enumerate(problems[:n]):
        correct = a + b
        wrong = sum_without_carry(a, b) if has_carry(a, b) else near_miss(correct, rng)
        rows.append(
            {"id": f"pair-{i:04d}", "prompt": prompt_for(a, b, 2), "chosen": answer_for(correct, 2), "rejected": answer_for(wrong, 2)}
        )
    return rows


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """An untrained tiny Llama policy (hidden 32, 2 layers) with an arithmetic tokenizer."""
    tok = train_tokenizer([f"{a:02d}+{b:02d}={a + b:03d}" for a in range(100) for b in range(100)], vocab_size=64)
    return save_pretrained_atomic(build_policy(TINY, tok, seed=0), tok, tmp_path_factory.mktemp("base") / "sft")
