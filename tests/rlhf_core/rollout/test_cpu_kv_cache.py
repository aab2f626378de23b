"""The CPU KV cache is sized in blocks for the engine's batch, not guessed in GiB."""
import json

import pytest

from rlhf_core.rollout.cpu_engine import CPU_BLOCK_SIZE, cpu_kv_cache

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


def test_the_policy_engine_holds_the_runs_sequences_not_the_models_context():
    """The rollout engine's context is the longest prompt plus a response (and the token the sync
    check asks for after a full-length one), capped by the model's:
    at SmolLM2-135M's shape (30 layers, 3 KV heads of 64) and 64 sequences its KV cache is 366 MiB
    instead of the 22.5 GiB its 8,192-token context would size."""
    from rlhf_core.rollout.factory import engine_context
    from rlhf_core.models.memory import kv_block_bytes, kv_cache_blocks

    assert engine_context([12, 40, 7], max_new_tokens=64, model_context=8192) == 105
    assert engine_context([12, 40, 7], max_new_tokens=64, model_context=96) == 96
    assert engine_context([], max_new_tokens=8, model_context=80) == 9
    smollm2 = kv_block_bytes(num_layers=30, num_kv_heads=3, head_dim=64)
    assert smollm2 == 2 * 30 * 3 * 64 * 4 * 128
    run = kv_cache_blocks(64, engine_context([40], 64, 8192)) * smollm2
    model = kv_cache_blocks(64, 8192) * smollm2
    assert run == 65 * smollm2 and run / 2**20 == pytest.approx(365.625)
    assert model == (64 * 64 + 1) * smollm2 and model / 2**30 == pytest.approx(22.5, rel=1e-3)


def test_the_engine_follows_the_trainers_precision_and_device_unless_told():
    from rlhf_core.config import RolloutEngineConfig
    from rlhf_core.rollout.factory import engine_settings

    auto = RolloutEngineConfig()
    assert engine_settings(auto, "fp32", "cpu") == {"dtype": "float32", "enforce_eager": True,
                                                    "gpu_memory_utilization": None}
    assert engine_settings(auto, "bf16", "cuda") == {"dtype": "bfloat16", "enforce_eager": False,
                                                     "gpu_memory_utilization": None}
    assert engine_settings(auto, "bf16", "cpu")["dtype"] == "float32"  # vLLM's CPU bf16 changes greedy answers
    assert engine_settings(auto, "fp32", "cuda")["dtype"] == "float32"
    told = RolloutEngineConfig(dtype="float16", enforce_eager=True, gpu_memory_utilization=0.3)
    assert engine_settings(told, "bf16", "cuda") == {"dtype": "float16", "enforce_eager": True,
                                                     "gpu_memory_utilization": 0.3}
