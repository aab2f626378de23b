"""The stages' memory estimates and the check against what the machine has available."""
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from rlhf_core.config import PolicyConfig, RewardConfig
from rlhf_core.models.memory import (
    ACTIVATION_BYTES,
    OFFLINE_STEP_BYTES,
    WORKER_OVERHEAD,
    MachineMemory,
    activation_bytes,
    memory_refusal,
    offline_stage_bytes,
    reward_stage_bytes,
    ways_to_use_less,
)

GiB = 2**30


def test_reward_stage_bytes_closed_form():
    # 1M parameters on 2 workers: 12 B/param each plus half of AdamW's 8; activations of
    # 2 x 4 sequences x 16 tokens x 3 layers x width 8; the per-process overhead
    per_worker = 12 * 10**6 + 4 * 10**6 + 128 * 3 * 8 * ACTIVATION_BYTES + WORKER_OVERHEAD
    assert reward_stage_bytes(10**6, 3, 8, workers=2, micro_batch_size=4, max_length=16) == 2 * per_worker
    assert activation_bytes(128, 3, 8) == 128 * 3 * 8 * ACTIVATION_BYTES


def test_reward_stage_bytes_with_frozen_layers():
    # 1 of 4 layers frozen: weights for all 1.2M, gradients, their flat copy and AdamW for 3/4 of
    # them, activations of the 3 layers that train
    trainable = 1_200_000 * 3 // 4
    activations = 128 * 3 * 8 * ACTIVATION_BYTES
    expected = 4 * 1_200_000 + 8 * trainable + 8 * trainable + activations + WORKER_OVERHEAD
    assert reward_stage_bytes(1_200_000, 4, 8, workers=1, micro_batch_size=4, max_length=16, frozen_layers=1) == expected
    # nothing frozen: the closed form above, 12 bytes a parameter and AdamW's 8
    assert reward_stage_bytes(10**6, 3, 8, workers=1, micro_batch_size=4, max_length=16) == (
        20 * 10**6 + 128 * 3 * 8 * ACTIVATION_BYTES + WORKER_OVERHEAD)


def test_activation_bytes_match_what_autograd_saves_in_a_llama_forward():
    """The tensors saved for the backward pass of a real forward (parameters excluded), counted once each."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=96, num_hidden_layers=2, intermediate_size=256, num_attention_heads=3,
                      num_key_value_heads=1, vocab_size=500, num_labels=1, pad_token_id=0)
    model = LlamaForSequenceClassification(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=torch.randint(1, 500, (8, 64))).logits.sum()
    estimate = activation_bytes(8 * 64, 2, 96)
    assert abs(sum(saved.values()) - estimate) / estimate < 0.15, (sum(saved.values()), estimate)


def test_offline_stage_bytes_closed_form():
    # 1M parameters, 3 layers, width 8, vocabulary 100; micro-batches of 4 pairs of up to 16
    # tokens: 128 sequences' tokens a pass
    tokens, fixed = 2 * 4 * 16, WORKER_OVERHEAD
    logits = tokens * 100 * 12
    lora = offline_stage_bytes(10**6, 3, 8, 100, workers=1, lora=True, micro_batch_size=4, max_length=16)
    assert lora == 4 * 10**6 + tokens * 3 * 8 * OFFLINE_STEP_BYTES + logits + fixed
    # full fine-tuning on 2 workers: weights, reference, gradients and ZeRO's copy (16) and half of AdamW's 8
    full = offline_stage_bytes(10**6, 3, 8, 100, workers=2, lora=False, micro_batch_size=4, max_length=16)
    assert full == 2 * (20 * 10**6 + tokens * 3 * 8 * OFFLINE_STEP_BYTES + logits + fixed)
    # checkpointing keeps each layer's input (4 bytes a unit of width) and one layer's full set
    checkpointed = offline_stage_bytes(10**6, 3, 8, 100, workers=1, lora=True, micro_batch_size=4, max_length=16,
                                       gradient_checkpointing=True)
    assert checkpointed == 4 * 10**6 + tokens * 8 * (3 * 4 + OFFLINE_STEP_BYTES) + logits + fixed
    assert checkpointed < lora


def test_usable_memory_counts_what_other_processes_hold():
    machine = MachineMemory(total=24 * GiB, available=18 * GiB)
    assert machine.usable() == 18 * GiB - int(0.05 * 24 * GiB)  # Ray kills above 95% of the total
    assert machine.usable(threshold=0.5) == 6 * GiB
    assert MachineMemory(total=24 * GiB, available=GiB).usable() == 0
    assert machine.describe() == "24.0 GiB total, 18.0 GiB available (6.0 GiB already in use)"


def test_a_stage_that_fits_the_total_but_not_what_is_available_is_refused():
    """Comparing with the total let a stage start that the processes beside it left no room for."""
    need = 16 * GiB
    assert memory_refusal("reward", need, MachineMemory(24 * GiB, 22 * GiB), ["reward.num_workers=2"]) is None
    message = memory_refusal("reward: the stage", need, MachineMemory(24 * GiB, 16 * GiB), ["reward.num_workers=2 (x)"])
    first, advice = message.splitlines()
    assert first.startswith("reward: the stage needs about 16.0 GiB, more than the 14.8 GiB it can use: 16.0 GiB "
                            "available of 24.0 GiB total, less the 1.2 GiB that Ray's memory monitor keeps free")
    assert advice == "to use less: reward.num_workers=2 (x); or stop other processes that hold memory"


def test_the_settings_named_are_the_stage_s_own_with_their_values():
    reward = ways_to_use_less("reward", RewardConfig(num_workers=2, micro_batch_size=32, max_length=64))
    assert [w.split(" (")[0] for w in reward] == ["reward.num_workers=2", "reward.micro_batch_size=32",
                                                  "reward.max_length=64"]
    assert "reward.grad_accum_steps" in reward[1]
    one = ways_to_use_less("reward", RewardConfig(num_workers=1, micro_batch_size=1, max_length=64))
    assert [w.split(" (")[0] for w in one] == ["reward.max_length=64"]  # already at their least: not named

    policy = [w.split(" (")[0] for w in ways_to_use_less("policy", PolicyConfig())]
    assert policy == ["policy.num_workers=2", "policy.micro_batch_size=64", "policy.lora.enabled=false",
                      "policy.gradient_checkpointing=false"]
    lora = [w.split(" (")[0] for w in ways_to_use_less("policy", PolicyConfig(
        lora={"enabled": True}, gradient_checkpointing=True))]
    assert lora == ["policy.num_workers=2", "policy.micro_batch_size=64"]
    dpo = [w.split(" (")[0] for w in ways_to_use_less("policy", PolicyConfig(algorithm="dpo"))]
    assert dpo[1:3] == ["policy.dpo.micro_batch_size=16", "policy.dpo.max_length=64"]
    assert [w.split(" (")[0] for w in ways_to_use_less("reward")] == [
        "reward.num_workers", "reward.micro_batch_size", "reward.max_length"]


QWEN_05B = dict(parameters=494_000_000, num_layers=24, hidden_size=896, kv_width=128, intermediate_size=4864,
                vocab_size=151_936)


def test_rank_0s_gpu_is_docs_gpu_md_arithmetic_for_one_h100_and_a_05b_model():
    """docs/gpu.md, (a): full fine-tuning on one GPU, reference, reward and audit beside it,
    micro-batches of 4 sequences of 1,024 tokens, 512 of them answer."""
    from rlhf_core.models.memory import GPU_PROCESS_OVERHEAD, GpuPolicyShape, gpu_policy_bytes

    parts = gpu_policy_bytes(GpuPolicyShape(**QWEN_05B, frozen_parameters=3 * 494_000_000, micro_batch_size=4,
                                            sequence_tokens=1024, response_tokens=512))
    table = {"actor": 7.4, "frozen": 2.8, "activations": 5.0, "logits": 4.1, "overhead": 3.0}  # the doc's GiB
    assert {k: round(v / GiB, 1) for k, v in parts.items()} == table
    assert parts["actor"] == 494_000_000 * 16 and parts["overhead"] == GPU_PROCESS_OVERHEAD
    assert round(sum(parts.values()) / GiB) == 22  # the doc's trainer total


def test_zero_lora_and_checkpointing_shrink_rank_0s_gpu_as_they_should():
    from rlhf_core.models.memory import GpuPolicyShape, gpu_policy_bytes

    n = QWEN_05B["parameters"]
    base = dict(QWEN_05B, frozen_parameters=0, micro_batch_size=1, sequence_tokens=1024, response_tokens=512)
    actor = {z: gpu_policy_bytes(GpuPolicyShape(**base, workers=8, zero_stage=z))["actor"] for z in (0, 1, 2, 3)}
    assert actor == {0: 16 * n, 1: 4 * n + 12 * n // 8, 2: 2 * n + 2 * n // 8 + 12 * n // 8,
                     3: 2 * n // 8 + 2 * n // 8 + 12 * n // 8}
    assert gpu_policy_bytes(GpuPolicyShape(**base, lora=True))["actor"] == 2 * n  # frozen bf16 base only
    assert gpu_policy_bytes(GpuPolicyShape(**base, with_critic=True))["actor"] == 2 * 16 * n
    full = gpu_policy_bytes(GpuPolicyShape(**base))["activations"]
    checkpointed = gpu_policy_bytes(GpuPolicyShape(**base, gradient_checkpointing=True))["activations"]
    per_layer = 1024 * 2 * (8 * 896 + 4 * 128 + 4 * 4864)
    assert full == 24 * per_layer and checkpointed == 1024 * 24 * 2 * 896 + per_layer
