"""The share of a GPU a rollout engine takes (vLLM's `gpu_memory_utilization`), from the run.

vLLM gives an engine `gpu_memory_utilization` of the device for its weights, activations and
KV cache, and fills all of it that the weights and activations leave with KV cache blocks. A
colocated engine shares rank 0's GPU with the trainer, so every byte beyond what the run's
rollouts need is taken from the trainer. With `policy.rollout.gpu_memory_utilization: null`
the share is sized from the run:

    weights / tp  +  MARGIN x kv_bytes_per_token x sequences x tokens / tp  +  OVERHEAD

over the device's memory, where sequences are a step's rollouts (vLLM's `max_num_seqs`),
tokens the engine's context (the longest prompt plus a response), and
`kv_bytes_per_token = 2 (K and V) x layers x kv_heads x head_dim x bytes of the dtype`. An
engine on GPUs of its own (`placement: separate`) takes `SEPARATE_SHARE`. A number in the
config is used as it is.
"""
from __future__ import annotations

from collections.abc import Callable

GIB = 1024**3
OVERHEAD_BYTES = 2 * GIB  # an estimate: CUDA graphs, the profiling pass's activations, the sampler's logits
MARGIN = 1.25  # KV blocks beyond the batch's: the block size's rounding, the prefix cache's
MIN_SHARE, MAX_SHARE = 0.05, 0.9
SEPARATE_SHARE = 0.9  # the GPU is the engine's alone
CPU_SHARE = 0.5  # unused by vLLM's CPU backend, which sizes its cache from VLLM_CPU_KVCACHE_SPACE


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def sized_share(weight_bytes: int, kv_per_token: int, sequences: int, tokens: int, device_bytes: int,
                tensor_parallel_size: int = 1) -> float:
    """The share of `device_bytes` an engine needs (module docstring), within [MIN_SHARE, MAX_SHARE]."""
    if device_bytes <= 0:
        raise ValueError(f"device memory must be positive, got {device_bytes}")
    need = (weight_bytes + MARGIN * kv_per_token * sequences * tokens) / tensor_parallel_size + OVERHEAD_BYTES
    return min(MAX_SHARE, max(MIN_SHARE, need / device_bytes))


def engine_share(configured: float | None, *, on_gpu: bool, separate: bool, sized: Callable[[], float]) -> float:
    """`policy.rollout.gpu_memory_utilization` as the engine gets it: the configured number, else
    `CPU_SHARE` on a CPU, `SEPARATE_SHARE` on GPUs of its own, `sized()` (`sized_share`) beside
    the trainer."""
    if configured is not None:
        return configured
    if not on_gpu:
        return CPU_SHARE
    return SEPARATE_SHARE if separate else sized()


def model_share(info, dtype_bytes: int, sequences: int, tokens: int, device_bytes: int,
                tensor_parallel_size: int = 1) -> float:
    """`sized_share` for the model `info` describes (`rlhf_core.models.pretrained.PretrainedInfo`)
    held in a dtype of `dtype_bytes`."""
    return sized_share(info.num_parameters * dtype_bytes,
                       kv_bytes_per_token(info.num_layers, info.num_kv_heads, info.head_dim, dtype_bytes),
                       sequences, tokens, device_bytes, tensor_parallel_size)
