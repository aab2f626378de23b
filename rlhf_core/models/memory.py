"""How much memory a training stage takes, and whether the machine has it: pure arithmetic on the
model's shape, the stage's settings and a snapshot of the machine's memory.

A stage can use the memory *available* when it starts (what other processes hold is not there
to take), less what Ray's memory monitor keeps free: the raylet kills worker processes once the
node's used memory passes `RAY_memory_usage_threshold` (0.95 by default) of its total. The
estimates count fp32 training with AdamW under ZeRO stage 1-2, as the stages run it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KILL_THRESHOLD = 0.95  # Ray's default RAY_memory_usage_threshold

# Resident memory a process holds beyond its tensors (torch, DeepSpeed, Ray; vLLM's CPU backend
# and its KV cache), from the peaks bench/pretrained_scale.py measured on a 111M model:
# 4.1 GiB per Ray Train worker, 2.4 GiB for the vLLM worker.
WORKER_OVERHEAD = int(1.5 * 2**30)
ENGINE_OVERHEAD = 2 * 2**30

# What a Llama-family layer keeps for the backward pass in fp32, in bytes per token per unit of
# width: the tensors autograd saved in a forward pass of transformers' LlamaForSequenceClassification
# at SmolLM2-135M's shape (width 576, 30 layers, MLP 1536, sdpa attention) came to 78-80 per token,
# layer and unit of width on 1,024 and 2,048 tokens (tests/rlhf_core/models/test_memory.py counts
# them the same way on a small model).
ACTIVATION_BYTES = 80


# Per GPU: the CUDA context, the caching allocator's slack and DeepSpeed's buffers (docs/gpu.md
# assumes the same figure). On an H100 the device's memory in use went 2.0 GiB (plain torch) and
# 5.5 GiB (DeepSpeed, ZeRO-2) beyond the allocated peak of a 387M-parameter GRPO step whose rollouts
# came from `generate` in the same process (`make gpu-check`, docs/benchmarks.md): one measurement.
GPU_PROCESS_OVERHEAD = 3 * 2**30


# The staging buffer of a CUDA IPC weight sync (vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES), grown to
# the largest tensor where one is larger (rlhf_core/rollout/ipc_transfer.py).
IPC_BUFFER_BYTES = 1 << 30


def ipc_buffer_bytes(info: Any) -> int:
    """The IPC sync's staging buffer on rank 0's GPU for a model of `info`'s shape: at least the
    embedding matrix in bf16, the largest tensor of the models the pipeline trains."""
    return max(IPC_BUFFER_BYTES, info.vocab_size * info.hidden_size * 2)


def gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


@dataclass(frozen=True)
class MachineMemory:
    """The machine's memory at one moment (psutil.virtual_memory's total and available)."""

    total: int
    available: int  # what a new process can take without swapping: other processes' memory is not in it

    def usable(self, threshold: float = KILL_THRESHOLD) -> int:
        """What a stage may add before the machine passes Ray's kill threshold."""
        return max(0, self.available - int((1 - threshold) * self.total))

    def describe(self) -> str:
        return (f"{gib(self.total)} GiB total, {gib(self.available)} GiB available "
                f"({gib(self.total - self.available)} GiB already in use)")


KV_BLOCK_TOKENS = 128  # vLLM's CPU block size: a sequence's cache is whole blocks


def kv_cache_blocks(sequences: int, tokens: int) -> int:
    """Blocks of KV_BLOCK_TOKENS that hold `sequences` sequences of `tokens` tokens, plus the one
    block vLLM keeps back."""
    return sequences * -(-tokens // KV_BLOCK_TOKENS) + 1


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 4) -> int:
    """One KV-cache block: keys and values of KV_BLOCK_TOKENS tokens in every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes * KV_BLOCK_TOKENS


def activation_bytes(tokens: int, num_layers: int, hidden_size: int) -> int:
    """Activations one forward pass over `tokens` tokens keeps for its backward pass (fp32)."""
    return tokens * num_layers * hidden_size * ACTIVATION_BYTES


def reward_stage_bytes(
    parameters: int, num_layers: int, hidden_size: int, *, workers: int, micro_batch_size: int, max_length: int,
    frozen_layers: int = 0,
) -> int:
    """An estimate of the reward stage's resident bytes, all workers together.

    Each worker holds the model's weights (4 bytes a parameter) and, for the parameters that
    train, their gradients, a flat copy of them (ZeRO's buffers; at stage 0 DeepSpeed's
    all-reduce bucket: a worker measured the same 4 bytes) and its shard of AdamW's two moments
    (8 / workers); the activations of one micro-batch (chosen and rejected: 2 x
    micro_batch_size sequences of up to max_length tokens) in the layers that train; and
    `WORKER_OVERHEAD`. With `frozen_layers` the trainable share is taken as the layers' share,
    the frozen embeddings counted as trainable (an upper bound). The ensemble's score heads are
    a few parameters on the same backbone, and the audit model trains after the proxy, not
    beside it: neither adds to the peak."""
    trained_layers = num_layers - min(frozen_layers, num_layers)
    trainable = parameters * trained_layers // num_layers if frozen_layers else parameters
    per_worker = (parameters * 4 + trainable * 8 + trainable * 8 // workers + WORKER_OVERHEAD
                  + activation_bytes(2 * micro_batch_size * max_length, trained_layers, hidden_size))
    return workers * per_worker


# What one micro-batch of a DPO / KTO step adds to a CPU worker, in bytes per token, layer and
# unit of width: the tensors autograd saves (97, counted with saved-tensor hooks on
# SmolLM2-135M-Instruct with LoRA), the reference's forward pass before the policy's, both passes'
# transient tensors, and what glibc's allocator keeps of them between steps rather than return.
# Calibrated on the chat task's DPO stage (bench/offline_memory.py): its worker peaked at 8.29 GiB
# over 32 steps and 8.44 GiB over 4, and offline_stage_bytes says 8.73.
OFFLINE_STEP_BYTES = 170


def offline_stage_bytes(
    parameters: int, num_layers: int, hidden_size: int, vocab_size: int, *, workers: int, lora: bool,
    micro_batch_size: int, max_length: int, gradient_checkpointing: bool = False,
) -> int:
    """An estimate of a DPO or KTO policy stage's resident bytes, all workers together.

    Each worker holds the policy's weights (4 bytes a parameter) and, without LoRA, a frozen
    reference (4), gradients and ZeRO's flat copy of them (8) and its shard of AdamW's moments
    (8 / workers); with LoRA the adapters are a rounding error and the reference is the policy
    with its adapters off. A micro-batch scores two sequences a row (2 x micro_batch_size of up
    to max_length tokens): `OFFLINE_STEP_BYTES` per token, layer and unit of width (with
    gradient checkpointing, each layer's input and one layer's full set), and the head's logits,
    taken at every position (fp32 logits, their log-softmax and its gradient: 12 bytes a token
    and vocabulary entry). Plus `WORKER_OVERHEAD`. The end of the stage (a merged copy and the
    reference beside the trained model, greedy answers, the held-out loss a micro-batch at a
    time) reuses what the steps' tensors left free: at SmolLM2's size it added 0.4-0.8 GiB to
    the steps' peak, inside the estimate's margin."""
    tokens = 2 * micro_batch_size * max_length
    weights = parameters * 4 if lora else parameters * (4 + 4 + 8) + parameters * 8 // workers
    step = (tokens * hidden_size * (4 * num_layers + OFFLINE_STEP_BYTES) if gradient_checkpointing
            else tokens * num_layers * hidden_size * OFFLINE_STEP_BYTES)
    logits = tokens * vocab_size * 12
    return workers * (weights + step + logits + WORKER_OVERHEAD)


# The settings that shrink a stage, each with the value that already uses least and why it helps.
_WORKERS = ("num_workers", 1, "each worker holds the whole model with its gradients and AdamW state")
_REWARD = (
    _WORKERS,
    ("micro_batch_size", 1, "activations grow with it; raise reward.grad_accum_steps to keep the batch"),
    ("max_length", None, "activations grow with it"),
)
_POLICY = (
    _WORKERS,
    ("micro_batch_size", 1, "activations and logits grow with it; the minibatch stays as it is"),
    ("lora.enabled", True, "true: adapters train, no reference copy, AdamW state for the adapters only"),
    ("gradient_checkpointing", True, "true: activations recomputed in the backward pass"),
)


def _offline(method: str) -> tuple:
    return (
        _WORKERS,
        (f"{method}.micro_batch_size", 1, f"activations grow with it; policy.{method}.batch_size stays"),
        (f"{method}.max_length", None, "activations grow with it"),
        ("lora.enabled", True, "true: adapters train, no reference copy, AdamW state for the adapters only"),
        ("gradient_checkpointing", True, "true: activations recomputed in the backward pass"),
    )


def _setting(cfg: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        cfg = getattr(cfg, name)
    return cfg


def ways_to_use_less(stage: str, cfg: Any = None) -> list[str]:
    """The settings of `stage` ("reward" | "policy") that take memory off it, with their values
    in `cfg` (its `RewardConfig` | `PolicyConfig`) when given; a setting already at its least is
    left out."""
    algorithm = getattr(cfg, "algorithm", None)
    table = _REWARD if stage == "reward" else _offline(algorithm) if algorithm in ("dpo", "kto") else _POLICY
    ways = []
    for key, least, why in table:
        if cfg is None:
            ways.append(f"{stage}.{key} ({why})")
        elif (value := _setting(cfg, key)) != least:
            shown = str(value).lower() if isinstance(value, bool) else value
            ways.append(f"{stage}.{key}={shown} ({why})")
    return ways


def advice(ways: Sequence[str]) -> str:
    """The block's last line: what to change."""
    return "to use less: " + "; ".join([*ways, "or stop other processes that hold memory"])


def memory_refusal(subject: str, need: int, machine: MachineMemory, ways: Sequence[str],
                   threshold: float = KILL_THRESHOLD) -> str | None:
    """None when `need` bytes fit in what `machine` can give a stage; else the message: `subject`
    (what needs it), the estimate, the available and total memory, and what to change."""
    usable = machine.usable(threshold)
    if need <= usable:
        return None
    return "\n".join([
        (f"{subject} needs about {gib(need)} GiB, more than the {gib(usable)} GiB it can use: {gib(machine.available)} "
         f"GiB available of {gib(machine.total)} GiB total, less the {gib(machine.available - usable)} GiB that Ray's "
         f"memory monitor keeps free (it kills workers above {threshold:.0%} of the total)"),
        advice(ways),
    ])


@dataclass(frozen=True)
class GpuPolicyShape:
    """What sets rank 0's GPU memory in the policy stage (docs/gpu.md's arithmetic)."""

    parameters: int
    num_layers: int
    hidden_size: int
    kv_width: int  # key/value heads x head size
    intermediate_size: int
    vocab_size: int
    frozen_parameters: int  # of the bf16 models beside the actor: reference (none with LoRA), reward, audit
    workers: int = 1
    zero_stage: int = 1
    lora: bool = False
    with_critic: bool = False
    micro_batch_size: int = 1
    sequence_tokens: int = 1024  # prompt plus answer
    response_tokens: int = 512  # logits are kept at the response positions only
    gradient_checkpointing: bool = False


def gpu_policy_bytes(shape: GpuPolicyShape) -> dict[str, int]:
    """Rank 0's GPU at the update's peak, by part, in bytes, for DeepSpeed in bf16 with fp32
    master weights and AdamW (what the stages run on GPUs; the engine's share is added by the
    caller, who knows the device's size):

    - actor: bf16 weights 2 bytes a parameter (sharded over the workers under ZeRO-3), bf16
      gradients 2 (sharded from ZeRO-2), fp32 master weights and two moments 12 (sharded from
      ZeRO-1); with LoRA the base is frozen bf16 weights (the adapters are a rounding error).
      PPO's critic costs as much again.
    - frozen: 2 bytes a parameter of the frozen models.
    - activations of one micro-batch: 2 bytes x (8d + 4kv + 4i) per token and layer; with
      gradient checkpointing each layer's input (2d) plus one layer's full set.
    - logits: micro-batch x response tokens x vocabulary x 14 bytes (bf16 logits, their fp32
      log-softmax and its gradient).
    - GPU_PROCESS_OVERHEAD."""
    n, w = shape.parameters, shape.workers
    if shape.lora:
        actor = 2 * n // (w if shape.zero_stage >= 3 else 1)
    else:
        actor = (2 * n // (w if shape.zero_stage >= 3 else 1) + 2 * n // (w if shape.zero_stage >= 2 else 1)
                 + 12 * n // (w if shape.zero_stage >= 1 else 1))
    per_token_layer = 2 * (8 * shape.hidden_size + 4 * shape.kv_width + 4 * shape.intermediate_size)
    tokens = shape.micro_batch_size * shape.sequence_tokens
    activations = (tokens * (shape.num_layers * 2 * shape.hidden_size + per_token_layer)
                   if shape.gradient_checkpointing else tokens * shape.num_layers * per_token_layer)
    return {
        "actor": actor * (2 if shape.with_critic else 1),
        "frozen": 2 * shape.frozen_parameters,
        "activations": activations,
        "logits": shape.micro_batch_size * shape.response_tokens * shape.vocab_size * 14,
        "overhead": GPU_PROCESS_OVERHEAD,
    }
