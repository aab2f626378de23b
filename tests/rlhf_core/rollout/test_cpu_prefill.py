"""A CPU engine never splits a prompt across scheduler steps (vLLM's CPU backend cannot sample
a seeded request whose prefill was split), and a step still takes whole batches of prompts."""
import json

import pytest

from rlhf_core.rollout.cpu_engine import CPU_PREFILL_TOKENS, cpu_prefill


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 80}))
    return tmp_path


@pytest.mark.parametrize(("seqs", "tokens", "budget"), [
    (256, 64, CPU_PREFILL_TOKENS),  # the trainer's batch: vLLM's default budget
    (8, 64, 512),  # capped at what 8 sequences of 64 tokens can hold (vLLM warns above it)
    (1, 64, 64),  # one prompt of the whole context still fits a step
    (16, 8192, 8192),  # a context longer than the default budget
    (8192, 1, 8192),  # one decode token for each sequence
    (64, None, 4096),  # the model's context length (80) when max_model_len is not given
])
def test_a_step_holds_a_whole_prompt_of_the_context_length(model_dir, seqs, tokens, budget):
    args = cpu_prefill(model_dir, seqs, tokens)
    assert args == {"enable_chunked_prefill": False, "max_num_batched_tokens": budget}
    assert budget >= (tokens or 80) and budget >= seqs  # what vLLM checks without chunked prefill
