"""A tiny policy directory that vLLM's server loads in seconds, for the serving tests and benchmarks."""
from __future__ import annotations

import random
from pathlib import Path

from rlhf_core.config import ModelConfig
from rlhf_core.data.synthetic import answer_for, prompt_for
from rlhf_core.models.llama import build_policy, save_pretrained_atomic
from rlhf_core.tokenizer import DEMO_CHAT_TEMPLATE, train_tokenizer

POLICY = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2)


def tiny_policy_dir(out_dir: Path, chat_template: str | None = DEMO_CHAT_TEMPLATE) -> Path:
    """An untrained demo-sized Llama and its BPE tokenizer, saved as a Hugging Face directory.
    The tokenizer carries `chat_template` (the demo's, as the pipeline trains it; None: none)."""
    rng = random.Random(0)
    pairs = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(256)]
    tok = train_tokenizer([prompt_for(a, b, 2) + answer_for(a + b, 2) for a, b in pairs], vocab_size=64,
                          chat_template=chat_template)
    return save_pretrained_atomic(build_policy(POLICY, tok, seed=0), tok, out_dir)
