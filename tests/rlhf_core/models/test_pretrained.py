"""Pretrained-format directories of several families, made locally with random weights."""
from pathlib import Path

import pytest
from transformers import DistilBertConfig

from rlhf_core.models.pretrained import (
    ENGINE_OVERHEAD,
    WORKER_OVERHEAD,
    PretrainedError,
    count_parameters,
    engine_cache,
    inspect_pretrained,
    is_hub_id,
    preflight,
    training_bytes,
)

@pytest.mark.parametrize("family, tied, kv_heads", [("llama", True, 1), ("qwen2", True, 1), ("mistral", False, 2)])
def test_families_are_read_from_metadata(tmp_path, make_pretrained, family, tied, kv_heads):
    path, model = make_pretrained(tmp_path, family, pad_is_eos=True)
    info = inspect_pretrained(path)
    assert info.model_type == family
    assert info.num_parameters == sum(p.numel() for p in model.parameters())  # a tied head counts once
    assert (info.head_dim, info.num_heads, info.num_kv_heads, info.num_layers) == (32, 2, kv_heads, 2)
    assert info.tie_word_embeddings is tied and info.has_chat_template and info.pad_is_eos
    assert info.context_length == 128


def test_sharded_weights_are_counted_through_the_index(tmp_path, make_pretrained):
    one, model = make_pretrained(tmp_path / "a", "mistral")
    sharded, _ = make_pretrained(tmp_path / "b", "mistral", shards=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert count_parameters(sharded) == count_parameters(one) == sum(p.numel() for p in model.parameters())


def test_a_directory_that_is_not_a_model_is_named(tmp_path):
    with pytest.raises(PretrainedError, match="model.pretrained: .* is not a directory"):
        inspect_pretrained(tmp_path / "missing")
    (tmp_path / "notes").mkdir()
    with pytest.raises(PretrainedError, match="holds no config.json: not a Hugging Face model directory"):
        inspect_pretrained(tmp_path / "notes")
    (tmp_path / "bert").mkdir()
    DistilBertConfig().save_pretrained(str(tmp_path / "bert"))
    with pytest.raises(PretrainedError, match="is a 'distilbert' model, not a causal language model"):
        inspect_pretrained(tmp_path / "bert")


def test_a_model_without_tokenizer_or_weights_is_named(tmp_path, make_pretrained):
    path, _ = make_pretrained(tmp_path, "llama")
    for f in path.glob("tokenizer*"):
        f.unlink()
    (path / "special_tokens_map.json").unlink(missing_ok=True)
    with pytest.raises(PretrainedError, match="has no tokenizer that transformers loads"):
        inspect_pretrained(path)
    path, _ = make_pretrained(tmp_path / "w", "llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(PretrainedError, match="holds no safetensors weights"):
        inspect_pretrained(path)


def test_hub_ids_are_told_apart_from_local_paths(tmp_path):
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert not is_hub_id(str(tmp_path)) and not is_hub_id("./a/b/c") and not is_hub_id("plain")


def test_preflight_names_every_problem_with_its_fix(tmp_path, make_pretrained):
    path, _ = make_pretrained(tmp_path, "llama", chat_template=False)
    info = inspect_pretrained(path)
    ok = dict(max_total_tokens=64, supported_head_sizes=[32, 64], needs_chat_template=False, workers=2,
              with_critic=False, memory_bytes=24 * 2**30)
    assert preflight(info, **ok) == []
    problems = preflight(info, **{**ok, "max_total_tokens": 200, "supported_head_sizes": [64, 128],
                                  "needs_chat_template": True, "memory_bytes": 1000})
    assert len(problems) == 4
    assert "take up to 200 tokens but the model's context is 128" in problems[0]
    assert "head size 32 is not one that vLLM's attention here supports (64, 128)" in problems[1]
    assert "has no chat template; set `model.chat_template`" in problems[2]
    assert "more than 80% of this machine's" in problems[3]


def test_training_bytes_closed_form():
    # 1M parameters, 2 workers: actor (12 + reference 4) * 2 + Adam 8 = 40 B/param, engine 4, reward 4 * 2;
    # a critic adds 12 * 2 + 8; fixed: 1.5 GiB a worker and 2 GiB for the engine
    fixed = 2 * WORKER_OVERHEAD + ENGINE_OVERHEAD
    assert training_bytes(10**6, workers=2, with_critic=False, reward_parameters=10**6) == 52 * 10**6 + fixed
    assert training_bytes(10**6, workers=2, with_critic=True, reward_parameters=0) == (44 + 32) * 10**6 + fixed


def test_the_estimate_is_within_a_fifth_of_the_measured_peaks():
    """The benchmark's 111M model: the sum of the stage's measured peaks against the estimate."""
    import json

    result = json.loads((Path(__file__).resolve().parents[3] / "bench/results/pretrained_scale.json").read_text())
    measured = sum(p["peak_rss_gib"] for p in result["peak_rss"] if "driver" not in p["process"]) * 2**30
    estimate = training_bytes(int(result["parameters_m"] * 1e6), workers=result["workers"], with_critic=False,
                              reward_parameters=int(result["parameters_m"] * 1e6))
    assert abs(estimate - measured) / measured < 0.2, (estimate / 2**30, measured / 2**30)


def test_preflight_compares_the_estimates_with_the_available_memory(tmp_path, make_pretrained):
    """The same machine total, another process holding most of it: refused, naming both stages'
    estimates, the available and total memory and the settings."""
    from rlhf_core.config import RewardConfig

    path, _ = make_pretrained(tmp_path, "llama")
    info = inspect_pretrained(path)
    reward = RewardConfig(num_workers=2, micro_batch_size=32, max_length=64)
    ok = dict(max_total_tokens=64, supported_head_sizes=None, needs_chat_template=False, workers=2,
              with_critic=False, memory_bytes=24 * 2**30, reward=reward)
    assert preflight(info, **ok, available_bytes=20 * 2**30) == []
    problems = preflight(info, **ok, available_bytes=2 * 2**30)
    assert len(problems) == 2
    policy, rm = (p.splitlines() for p in problems)
    assert policy[0].startswith("model.pretrained: the policy stage (") and "on 2 workers) needs about" in policy[0]
    assert "2.0 GiB available of 24.0 GiB total" in policy[0]
    assert "policy.lora.enabled" in policy[1] and "policy.gradient_checkpointing" in policy[1]
    assert rm[0].startswith("model.pretrained: the reward stage (") and "64 sequences of up to 64 tokens" in rm[0]
    assert "reward.num_workers=2" in rm[1] and "reward.micro_batch_size=32" in rm[1] and "reward.max_length=64" in rm[1]
    # training on GPUs or another cluster: this machine's memory is not what the stages use
    assert preflight(info, **ok, available_bytes=2 * 2**30, trains_here=False) == []
    assert preflight(info, **{**ok, "memory_bytes": 2**20}, trains_here=False) == []
    assert preflight(info, **{**ok, "max_total_tokens": 10**6}, trains_here=False)  # the other checks still hold


def test_the_preflight_counts_the_engines_kv_cache(tmp_path, make_pretrained):
    """The engine's KV cache is in the policy stage's estimate: sized for the model's context a
    cache can be what refuses a run that fits at the run's own lengths."""
    from rlhf_core.models.memory import kv_block_bytes, kv_cache_blocks

    path, _ = make_pretrained(tmp_path, "llama")
    info = inspect_pretrained(path)
    ok = dict(max_total_tokens=64, supported_head_sizes=None, needs_chat_template=False, workers=2,
              with_critic=False, memory_bytes=24 * 2**30)
    base = training_bytes(info.num_parameters, workers=2, with_critic=False, reward_parameters=info.num_parameters)
    kv = kv_cache_blocks(64, 128) * kv_block_bytes(info.num_layers, info.num_kv_heads, info.head_dim)
    assert training_bytes(info.num_parameters, workers=2, with_critic=False, reward_parameters=info.num_parameters,
                          kv_cache=kv) == base + kv
    machine = dict(available_bytes=base + kv + 2 * 2**30)  # room for the estimate, and Ray's 5% of 24 GiB
    assert preflight(info, **ok, **machine, engine_sequences=64, engine_tokens=128) == []
    huge = preflight(info, **ok, **machine, engine_sequences=64 * 1024, engine_tokens=128)
    assert len(huge) == 1 and "the policy stage" in huge[0]


def qwen_05b_info() -> "PretrainedInfo":
    """Qwen2.5-0.5B's shape, as the GPU check's memory hand-off sizes the one-GPU plan from it."""
    from bench.gpu_handoff import QWEN_05B
    from rlhf_core.models.pretrained import PretrainedInfo

    return PretrainedInfo(path="qwen", **QWEN_05B)


def test_the_one_gpu_config_fits_an_h100_and_a_smaller_gpu_is_refused_with_what_to_change():
    from rlhf_core.config.loading import load_config
    from rlhf_core.models.gpu_room import gpu_memory_problem

    repo = Path(__file__).resolve().parents[3]
    cfg = load_config(repo / "configs" / "gpu-1xh100-0.5b.yaml")
    awake = cfg.model_copy(update={"policy": cfg.policy.model_copy(update={
        "rollout": cfg.policy.rollout.model_copy(update={"sleep": False})})})
    problem, estimate = gpu_memory_problem(qwen_05b_info(), awake, 80 * 2**30, reward_parameters=494_000_000)
    assert problem is None
    # docs/gpu.md's (a): 22 GiB of trainer, and the engine's share sized from the run (models.engine_share):
    # bf16 weights, the KV cache of a step's rollouts at prompt + answer length, 2 GiB besides
    info, cache = qwen_05b_info(), engine_cache(qwen_05b_info(), awake)
    kv = 2 * info.num_layers * info.num_kv_heads * info.head_dim * 2
    engine = info.num_parameters * 2 + 1.25 * kv * cache["engine_sequences"] * cache["engine_tokens"] + 2 * 2**30
    assert f"engine {engine / 2**30:.1f}" in estimate and "engine 14.2" in estimate  # not half the GPU (40 GiB)
    assert "about 36.3 GiB of 80.0" in estimate and "actor 7.4" in estimate
    problem, _ = gpu_memory_problem(qwen_05b_info(), awake, 32 * 2**30, reward_parameters=494_000_000)
    assert problem is not None and problem.startswith("model.pretrained: rank 0's GPU in the policy stage: about")
    # asleep during the update (the default on GPU), the engine's share and the update's peak never meet
    fits, estimate = gpu_memory_problem(qwen_05b_info(), cfg, 40 * 2**30, reward_parameters=494_000_000)
    assert fits is None and "about 27.3 GiB of 40.0" in estimate and "the engine asleep" in estimate
    problem, _ = gpu_memory_problem(qwen_05b_info(), cfg, 24 * 2**30, reward_parameters=494_000_000)
    for change in ("policy.rollout.gpu_memory_utilization=0.59", "policy.micro_batch_size=4",
                   "policy.lora.enabled=false", "policy.zero_stage=2"):
        assert change in problem, change


def test_the_ipc_sync_buffer_is_vllms_and_sets_the_gpu_peak_only_where_it_outweighs_the_update():
    from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES

    from rlhf_core.config.loading import load_config
    from rlhf_core.models.memory import IPC_BUFFER_BYTES, ipc_buffer_bytes
    from rlhf_core.models.gpu_room import gpu_memory_problem

    assert IPC_BUFFER_BYTES == DEFAULT_PACKED_BUFFER_SIZE_BYTES
    info = qwen_05b_info()
    assert ipc_buffer_bytes(info) == IPC_BUFFER_BYTES  # 151,936 x 896 in bf16 is 272 MB
    big_vocab = info.__class__(**{**info.__dict__, "vocab_size": 1_000_000})
    assert ipc_buffer_bytes(big_vocab) == 1_000_000 * 896 * 2

    repo = Path(__file__).resolve().parents[3]
    cfg = load_config(repo / "configs" / "gpu-1xh100-0.5b.yaml")
    _, streamed = gpu_memory_problem(info, cfg, 40 * 2**30, reward_parameters=494_000_000)
    about = lambda estimate: float(estimate.split("about ")[1].split(" GiB")[0])  # noqa: E731
    assert about(streamed) == 27.3  # the generation's peak: the sync's buffer changes nothing

    # an engine awake throughout and an update holding almost nothing (one short sequence a micro-batch,
    # checkpointed): the sync, with its 1 GiB buffer, is the peak; a file sync has none
    def small(weight_sync: str):
        policy = cfg.policy.model_copy(update={
            "micro_batch_size": 1, "max_new_tokens": 8, "gradient_checkpointing": True,
            "rollout": cfg.policy.rollout.model_copy(update={"sleep": False, "weight_sync": weight_sync})})
        reward = cfg.reward.model_copy(update={"max_length": 16})
        return about(gpu_memory_problem(info, cfg.model_copy(update={"policy": policy, "reward": reward}), 80 * 2**30,
                                        reward_parameters=494_000_000)[1])

    assert 0.5 < small("stream") - small("file") <= 1.0


def smollm2_info() -> "PretrainedInfo":
    """SmolLM2-135M-Instruct's shape, as `make chat-model` converts it."""
    from rlhf_core.models.pretrained import PretrainedInfo

    return PretrainedInfo(path="smollm2", model_type="llama", num_parameters=134_515_008, num_layers=30,
                          hidden_size=576, head_dim=64, num_heads=9, num_kv_heads=3, vocab_size=49_152,
                          context_length=8192, intermediate_size=1536, tie_word_embeddings=True,
                          has_chat_template=True, pad_is_eos=True)


def chat_config(algorithm: str):
    from rlhf_core.config.loading import load_config

    repo = Path(__file__).resolve().parents[3]
    return load_config(repo / "configs/chat.yaml", overrides=[f"policy.algorithm={algorithm}"])


def test_a_dpo_or_kto_stage_is_estimated_as_it_runs_and_refused_with_its_own_settings():
    """No engine and no reward model in an offline stage: the pairs' activations and logits are
    what it holds, and the settings that shrink it are the method's."""
    from rlhf_core.models.pretrained import offline_policy_bytes, stage_estimates

    info = smollm2_info()
    for algorithm in ("dpo", "kto"):
        cfg = chat_config(algorithm)
        assert stage_estimates(info, cfg)["policy"] == offline_policy_bytes(info, cfg.policy)
    cfg = chat_config("dpo")
    need = offline_policy_bytes(info, cfg.policy)
    ok = dict(max_total_tokens=96, supported_head_sizes=None, needs_chat_template=False, workers=1,
              with_critic=False, memory_bytes=24 * 2**30, policy=cfg.policy)
    assert preflight(info, **ok, available_bytes=need + 2 * 2**30) == []
    (problem,) = preflight(info, **ok, available_bytes=need)
    first, advice = problem.splitlines()
    assert first.startswith("model.pretrained: the policy stage (dpo, 135M parameters on 1 workers) needs about")
    assert "policy.dpo.micro_batch_size=16" in advice and "policy.dpo.max_length=64" in advice
    assert "policy.gradient_checkpointing=false" in advice and "lora.enabled" not in advice  # LoRA is already on


def test_the_chat_stages_estimates_are_within_a_fifth_of_their_measured_peaks():
    """bench/chat_gain.py's runs of configs/chat.yaml: each stage's worker (and the policy stage's
    engine) at its peak against the preflight's estimate for the config that ran; and the DPO
    stage's worker alone (bench/offline_memory.py), over every step and over a few, and KTO's."""
    import json

    from rlhf_core.models.pretrained import stage_estimates

    repo = Path(__file__).resolve().parents[3]
    info = smollm2_info()
    for name in ("offline_memory_full", "offline_memory", "offline_memory_kto"):
        alone = json.loads((repo / f"bench/results/{name}.json").read_text())
        ratio = stage_estimates(info, chat_config(alone["algorithm"]))["policy"] / 2**30 / max(
            alone["rank0_peak_gib_by_phase"].values())
        assert 0.8 <= ratio <= 1.2, (name, ratio)
    rows = json.loads((repo / "bench/results/chat_gain.json").read_text())["rows"]
    checked = 0
    for row in rows:
        estimate = stage_estimates(info, chat_config(row["algorithm"]))
        workers = [p["peak_rss_gib"] for p in row["peak_rss"] if p["process"].startswith("Ray Train worker")]
        engine = sum(p["peak_rss_gib"] for p in row["peak_rss"] if p["process"].startswith("vLLM"))
        measured = {"reward": min(workers), "policy": max(workers) + engine}  # the reward stage's worker is the smaller
        for stage in ("reward", "policy"):
            ratio = estimate[stage] / 2**30 / measured[stage]
            assert 0.8 <= ratio <= 1.2, (row["algorithm"], row["seed"], stage, ratio)
            checked += 1
    assert checked >= 12
