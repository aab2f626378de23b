"""The rollout engine's front door: `open_engine` decides, from `policy.rollout` and what the
trainer holds, which engine a run gets (one `RolloutEngine` beside the trainer, or an
`EngineGroup` of engines of their own), its dtype and memory share, how weights reach it
(`weight_transport`) and whether it sleeps while the trainer updates. Both engines answer the
same verbs (`Engine`); the trainer talks to nothing else."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from rlhf_core.config import RolloutEngineConfig, ServingConfig
from rlhf_core.models.engine_share import engine_share, model_share


class Engine(Protocol):
    """What a trainer may ask of its rollout engine."""

    last_metrics: dict[str, float]  # rollout/* figures of the last start, generation, sync and sleep
    max_model_len: int | None  # the longest sequence it takes (None: the model's own context)

    def generate(self, prompts, n: int = 1, temperature: float = 1.0, top_p: float = 1.0, max_tokens: int = 64,
                 seed: int | None = None) -> list[Any]: ...

    def sync_weights(self, weights) -> float: ...

    def probe(self, prompt_ids, response_ids) -> list[list[list[float]]]: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


def open_engine(model_dir: str | Path, rollout: RolloutEngineConfig, *, precision: str, device: torch.device,
                seed: int, max_num_seqs: int, max_model_len: int, pipelined: bool,
                bundles: list[dict[str, float]] | None = None, master_address: str = "127.0.0.1",
                name: str = "rollout-engine") -> Engine:
    """The engine `policy.rollout` asks for, for a trainer computing in `precision` on `device`:
    with `placement: separate`, `rollout.num_engines` engines in the placement groups `bundles`
    (what the trainer's cluster reserved for each, named `name`-i: give each run its own),
    streaming from `master_address`; else one
    engine in the trainer's process, a guest of its thread unless `pipelined` (then it generates
    on a thread of its own)."""
    settings = engine_settings(rollout, precision, device.type)
    settings["gpu_memory_utilization"] = engine_share(
        rollout.gpu_memory_utilization, on_gpu=device.type == "cuda", separate=rollout.placement == "separate",
        sized=lambda: _sized_on(device, model_dir, settings["dtype"], max_num_seqs, max_model_len))
    transport = weight_transport(rollout, settings["dtype"], device, master_address)
    if rollout.placement == "separate":
        from rlhf_core.rollout.engine_group import EngineGroup  # noqa: PLC0415

        if bundles is None:
            raise ValueError("policy.rollout.placement: separate needs the placement groups the cluster reserved")
        return EngineGroup(str(model_dir), num_engines=rollout.num_engines, tensor_parallel_size=rollout.tensor_parallel_size,
                           use_gpu=device.type == "cuda", bundles=bundles, transport=transport, seed=seed,
                           max_num_seqs=max_num_seqs, max_model_len=max_model_len, name=name, **settings)
    from rlhf_core.rollout.vllm_engine import RolloutEngine  # noqa: PLC0415

    return RolloutEngine(model_dir, seed=seed, max_num_seqs=max_num_seqs, max_model_len=max_model_len, transport=transport,
                         sleep_mode=engine_sleeps(rollout, pipelined, device.type), guest=not pipelined,
                         **settings)


def open_serving_engine(model_dir: str | Path, serving: ServingConfig, device: torch.device, *, max_num_seqs: int,
                        max_model_len: int) -> Engine:
    """An engine of the kind `serving` runs for users (vLLM in `serving.dtype`, eager), in this
    process, for greedy answers to compare policies by: the gates judge what users will get.
    Its KV cache is serving's on a CPU (`serving.kv_cache_gib`); on a GPU its share is sized for
    `max_num_seqs` sequences of `max_model_len` tokens, as a colocated rollout engine's is."""
    from rlhf_core.rollout.vllm_engine import RolloutEngine  # noqa: PLC0415

    on_gpu = device.type == "cuda"
    sizing_dtype = "float32" if serving.dtype == "float32" or (serving.dtype == "auto" and not on_gpu) else "bfloat16"
    share = engine_share(None, on_gpu=on_gpu, separate=False,
                         sized=lambda: _sized_on(device, model_dir, sizing_dtype, max_num_seqs, max_model_len))
    return RolloutEngine(model_dir, dtype=serving.dtype, seed=0, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                         kv_cache_gib=None if on_gpu else serving.kv_cache_gib, enforce_eager=True,
                         gpu_memory_utilization=share)


def _sized_on(device: torch.device, model_dir, dtype: str, sequences: int, tokens: int) -> float:
    """The share a colocated engine of the model in `model_dir` needs on `device` (`rlhf_core.models.engine_share`)."""
    from rlhf_core.models.pretrained import inspect_pretrained  # noqa: PLC0415

    dtype_bytes = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    return model_share(inspect_pretrained(model_dir), dtype_bytes, sequences, tokens,
                       torch.cuda.get_device_properties(device).total_memory)


def engine_sleeps(rollout: RolloutEngineConfig, pipelined: bool, device_type: str) -> bool:
    """`policy.rollout.sleep`: null sleeps on GPU when the engine is idle during the update (not
    pipelined: a pipelined engine generates during the update; the config refuses sleep: true with it)."""
    if rollout.placement == "separate":  # engines of their own share no device with the trainer
        return False
    return rollout.sleep if rollout.sleep is not None else (device_type == "cuda" and not pipelined)


def release_cached_memory() -> None:
    """Hand the blocks torch's caching allocator holds in this process, unused, back to the
    device, so that a colocated engine waking in another process can map them: the sleep
    discount of the preflight counts on it. Every engine calls it before it wakes. Nothing to do
    off CUDA."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def streams(rollout: RolloutEngineConfig, device_type: str) -> bool:
    """Whether `policy.rollout.weight_sync` streams the weights (stream; auto on a GPU) rather than
    writing a file."""
    return rollout.weight_sync == "stream" or (rollout.weight_sync == "auto" and device_type == "cuda")


def weight_transport(rollout: RolloutEngineConfig, engine_dtype: str, device: torch.device,
                     master_address: str = "127.0.0.1"):
    """`policy.rollout.weight_sync` as a transport: a file on CPU by default, streamed over gloo where
    a CPU run asks for it. Streamed on a GPU, in the engine's dtype (bf16 halves what crosses): by
    CUDA IPC to a colocated engine, which shares rank 0's GPU (NCCL refuses two ranks on one GPU);
    over NCCL to engines of their own (`placement: separate`), the trainer's end listening on
    `master_address` (default loopback)."""
    from rlhf_core.rollout.weight_sync import SafetensorsFileTransport  # noqa: PLC0415  (rank 0 only)
    from rlhf_core.rollout.weight_transfer import GLOO_BACKEND, NCCL_BACKEND, StreamingTransport  # noqa: PLC0415

    if not streams(rollout, device.type):
        return SafetensorsFileTransport(timeout_s=rollout.sync_timeout_s)
    dtype, on_gpu = getattr(torch, engine_dtype), device.type == "cuda"
    if on_gpu and rollout.placement == "colocated":
        from rlhf_core.rollout.ipc_transfer import IpcTransport  # noqa: PLC0415

        return IpcTransport(dtype=dtype, device=device, timeout_s=rollout.sync_timeout_s)
    return StreamingTransport(NCCL_BACKEND if on_gpu else GLOO_BACKEND, dtype=dtype, device=device,
                              timeout_s=rollout.sync_timeout_s, master_address=master_address)


def engine_settings(rollout: RolloutEngineConfig, precision: str, device_type: str) -> dict[str, Any]:
    """`RolloutEngine`'s dtype, eager mode and configured memory share (None: `open_engine` sizes
    it, `rlhf_core.models.engine_share`) from `policy.rollout`, for a trainer computing in `precision` (fp32,
    bf16) on a `device_type` (cpu, cuda) device."""
    # auto: bf16 where the trainer computes in bf16 on a GPU; float32 on CPU, where vLLM's bf16 kernels
    # changed 9 of 64 greedy answers of the demo's policy against its fp32 trainer (vllm_engine.py)
    on_gpu_bf16 = device_type == "cuda" and precision == "bf16"
    dtype = rollout.dtype if rollout.dtype != "auto" else ("bfloat16" if on_gpu_bf16 else "float32")
    eager = rollout.enforce_eager if rollout.enforce_eager is not None else device_type == "cpu"
    return {"dtype": dtype, "enforce_eager": eager, "gpu_memory_utilization": rollout.gpu_memory_utilization}


def engine_context(prompt_tokens: list[int], max_new_tokens: int, model_context: int) -> int:
    """The engine's `max_model_len`: the longest of the prompts it generates from (training,
    rounds and held-out prompts, `prompt_tokens` of each as the engine tokenises it) plus
    `max_new_tokens`, plus one (the check after a sync scores a full-length answer as a prompt
    and vLLM asks for a token after it), never more than the model's own context. A model's
    context (8,192 tokens for SmolLM2) would size a CPU KV cache for sequences 50-100 times
    longer than a run's."""
    return min(model_context, max(prompt_tokens, default=0) + max_new_tokens + 1)
