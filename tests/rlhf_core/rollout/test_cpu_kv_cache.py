"""The CPU KV cache is sized in blocks for the engine's batch, not guessed in GiB."""
import json

import pytest

from rlhf_core.rollout.vllm_engine import CPU_BLOCK_SIZE, cpu_kv_cache

LLAMA_25M = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8, "num_hidden_layers": 8,
             "max_position_embeddings": 80}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_25M))
    return tmp_path


@pytest.mark.parametrize(("seqs", "tokens", "blocks"), [
    (256, 80, 257),  # one 128-token block per sequence, plus the block vLLM keeps back
    (256, 128, 257),
    (256, 129, 513),  # a token past the block: two blocks per sequence
    (1, 1, 2),
    (64, None, 65),  # the model's context length (80) when max_model_len is not given
])
def test_one_block_count_per_sequence_of_max_model_len(model_dir, seqs, tokens, blocks):
    args = cpu_kv_cache(model_dir, seqs, tokens)
    assert args["block_size"] == CPU_BLOCK_SIZE == 128
    assert args["num_gpu_blocks_override"] == blocks
    # K and V, 8 layers x 8 heads x 64 dims, float32, 128 tokens: 4 MiB a block
    assert args["kv_cache_memory_bytes"] == blocks * 2 * 8 * 8 * 64 * 4 * 128 == blocks * 4 * 2**20


def test_grouped_query_attention_counts_kv_heads_only(model_dir):
    (model_dir / "config.json").write_text(json.dumps({**LLAMA_25M, "num_key_value_heads": 2, "head_dim": 32}))
    assert cpu_kv_cache(model_dir, 1, 80)["kv_cache_memory_bytes"] == 2 * (2 * 8 * 2 * 32 * 4 * 128)
