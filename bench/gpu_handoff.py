"""The memory hand-off between the policy stage's trainer and its colocated engine on one GPU, at
the preflight's part sizes: rank 0 of `configs/gpu-1xh100-0.5b.yaml` on Qwen2.5-0.5B's shape
(`rlhf_core.models.gpu_room.policy_parts`), each part held as a block of that many bytes: the
trainer's in this process, the engine's share in the stand-in engine's process
(`bench/stand_in_engine.py`, its KV cache block the whole share), in the order a step takes them:

    engine awake, the trainer's model state held  ->  the engine sleeps  ->  the trainer's update
    (activations and logits)  ->  the update's blocks freed, to torch's cache  ->  the engine wakes
    (the trainer's cache handed back first, `release_cached_memory`) and takes the weights

It records the device's free memory at each turn, whether the engine's share would have fitted
had the trainer kept its cache, and the most memory in use against the preflight's estimate of
rank 0 (`policy_gpu_need`). Not in it: the IPC sync's staging buffer, and what CUDA's contexts and
kernels take beyond the estimate's overhead. A dry run holds every part at 1/1024 of its size on
the CPU, where nothing is measured: it runs the turns.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "gpu-1xh100-0.5b.yaml"
# Qwen2.5-0.5B's shape (its config.json), which the one-GPU plan is sized for; the preflight tests use it too
QWEN_05B = dict(model_type="qwen2", num_parameters=494_000_000, num_layers=24, hidden_size=896, head_dim=64,
                num_heads=14, num_kv_heads=2, vocab_size=151_936, context_length=32_768, intermediate_size=4864,
                tie_word_embeddings=True, has_chat_template=True, pad_is_eos=False)
GIB = 2**30


def run_handoff(engine_dir: Path, device: torch.device) -> dict:
    """The turns above with a stand-in engine on the model in `engine_dir` -> the figures and the checks."""
    from bench.stand_in_engine import StandInEngine  # noqa: PLC0415
    from rlhf_core.config.loading import load_config  # noqa: PLC0415
    from rlhf_core.models.gpu_room import policy_parts  # noqa: PLC0415
    from rlhf_core.models.pretrained import PretrainedInfo  # noqa: PLC0415

    cuda = device.type == "cuda"
    total = torch.cuda.get_device_properties(device).total_memory if cuda else 80 * GIB
    need, parts, sleeps = policy_parts(PretrainedInfo(path="qwen2.5-0.5b", **QWEN_05B), load_config(CONFIG), total,
                                       reward_parameters=QWEN_05B["num_parameters"])
    scale = 1 if cuda else 1 / 1024

    def block(name: str) -> torch.Tensor:
        return torch.empty(int(parts[name] * scale), dtype=torch.uint8, device=device)

    def in_use() -> float | None:
        return (total - torch.cuda.mem_get_info(device)[0]) / GIB if cuda else None

    turns: dict[str, float | None] = {}
    start = time.perf_counter()
    held = [block("actor"), block("frozen")]  # the trainer's model state: weights, gradients, optimizer, frozen models
    engine = StandInEngine(engine_dir, dtype="bfloat16" if cuda else "float32", device=device, seed=0,
                           max_model_len=16, kv_cache_bytes=int(parts["engine"] * scale), sleep_mode=True)
    try:
        turns["engine awake, trainer's model state held"] = in_use()
        engine.release()
        turns["engine asleep"] = in_use()
        update = [block("activations"), block("logits")]
        turns["trainer's update"] = in_use()
        del update
        turns["update done, its blocks in torch's cache"] = in_use()
        cached_free = torch.cuda.mem_get_info(device)[0] if cuda else None
        engine.sync_weights({})  # the wake's turns; the weights' bytes are in the engine's block
        turns["engine awake again"] = in_use()
        free_at_wake = engine.last_metrics.get("rollout/free_at_wake_gib")
    finally:
        engine.close()
        del held
    peak = max((v for v in turns.values() if v is not None), default=None)
    checks = {"the engine woke after the update": not engine.asleep}
    if cuda:
        checks["the engine's share fitted at its wake"] = free_at_wake * GIB >= parts["engine"]
    return {"config": str(CONFIG.relative_to(REPO)), "scale": scale, "sleeps": sleeps,
            "parts_gib": {k: v / GIB for k, v in parts.items()}, "preflight_rank0_gib": need / GIB,
            "in_use_gib": turns, "peak_in_use_gib": peak, "free_at_wake_gib": free_at_wake,
            "would_fit_without_release": None if cached_free is None else cached_free >= parts["engine"],
            "seconds": time.perf_counter() - start, "checks": checks}
