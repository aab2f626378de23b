"""A tiny base policy to build reward models from, and a tiny SFT policy on the demo task to
optimise (the Ray cluster is in tests/conftest.py)."""
from __future__ import annotations

import random

import pytest
import torch

from rlhf_core.config import ModelConfig, PipelineConfig
from rlhf_core.data.schema import read_table
from rlhf_core.data.synthetic import (
    answer_for, generate_demo_data, has_carry, near_miss, prompt_for, sum_without_carry,
)
from rlhf_core.models.llama import build_policy, save_pretrained_atomic
from rlhf_core.models.reward import reward_model_from_base, reward_stats, save_reward_model, score
from rlhf_core.tokenizer import load_tokenizer, train_tokenizer
from rlhf_core.training.base_policy import make_base_policy

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


N_EVAL = 48  # held-out prompts of the test's demo data


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """Demo data, a tiny SFT policy and an (untrained-head) reward model, built once."""
    tmp = tmp_path_factory.mktemp("policy-demo")
    cfg = PipelineConfig.model_validate({
        "data": {"demo": {"seed": 0, "n_sft": 2000, "n_pairs": 400, "n_eval": N_EVAL}},
        "model": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2},
        "sft": {"epochs": 3, "batch_size": 32, "learning_rate": 3e-3, "warmup_steps": 5},
    })
    files = generate_demo_data(cfg.data.demo, tmp / "data")
    sft, prefs, evals = read_table(files.sft), read_table(files.preferences), read_table(files.eval)
    texts = list(sft["prompt"] + sft["completion"]) + list(prefs["prompt"] + prefs["chosen"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        base = make_base_policy(list(sft["prompt"]), list(sft["completion"]), texts, list(evals["prompt"]),
                                list(evals["answer"]), cfg, tmp / "sft")
        rm = reward_model_from_base(base.path, seed=0).eval()
        tok = load_tokenizer(base.path)
        raw = score(rm, tok, list(prefs["prompt"][:64]), list(prefs["chosen"][:64]), max_length=32)
        save_reward_model(rm, tok, tmp / "rm", reward_stats(raw))
    finally:
        torch.set_num_threads(threads)
    return {
        "sft": base.path, "rm": tmp / "rm", "sft_accuracy": base.eval_accuracy,
        "pairs": prefs[["id", "prompt", "chosen", "rejected"]].to_dict("records"),
        "prompts": sorted(set(prefs["prompt"])), "eval_prompts": list(evals["prompt"]), "eval_answers": list(evals["answer"]),
    }
