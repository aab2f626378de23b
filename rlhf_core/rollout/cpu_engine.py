"""Where a CPU rollout engine's processes run and what its KV cache holds: the settings
`vllm_engine.RolloutEngine` starts vLLM with on CPU (see that module's docstring for why),
the rendezvous file of an executor in this process, and the state vLLM changes in a process
that hosts its engine core or worker (global RNGs, torch threads, matmul precision, the default
process group). Each change to vLLM's or torch's behaviour here is listed in `rlhf_core.patches`."""
from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.platforms import current_platform
from vllm.v1.executor import multiproc_executor, uniproc_executor

from rlhf_core.models.memory import KV_BLOCK_TOKENS, kv_block_bytes, kv_cache_blocks
from rlhf_core.rng import rng_state, set_rng_state

CPU_BLOCK_SIZE = KV_BLOCK_TOKENS  # vLLM's CPU default, stated so the block count uses the same size
CPU_PREFILL_TOKENS = 4096  # vLLM's CPU default token budget of a scheduler step


@contextmanager
def rendezvous_in(path: Path | None) -> Iterator[None]:
    """While an engine starts: an executor in this process (on CPU the engine core runs here)
    names its worker's rendezvous file (torch's FileStore, `vllm_dist_<hex>`) in `path`, not in
    the temp directory, where a killed process leaves it. vLLM 0.32's executors take the name
    from their module's `get_file_store_init_method` (vLLM is pinned in constraints.txt)."""
    if path is None:
        yield
        return
    executors = [m for m in (multiproc_executor, uniproc_executor) if hasattr(m, "get_file_store_init_method")]
    saved = [m.get_file_store_init_method for m in executors]
    for module in executors:
        module.get_file_store_init_method = lambda: f"file://{path}/vllm_dist_{uuid.uuid4().hex}"
    try:
        yield
    finally:
        for module, original in zip(executors, saved):
            module.get_file_store_init_method = original


def worker_fits_here() -> bool:
    """Whether an engine can run its worker in this process although the process goes on with
    work of its own (a trainer's rank, the CLI): vLLM's "uni" executor, as a guest. On CPU only,
    with the engine core here too (`VLLM_ENABLE_V1_MULTIPROCESSING` unset or 0); torch.distributed
    not started or a world of one (vLLM builds its groups over the process's whole world: in a
    larger one every rank would have to take part); one memory node (vLLM's CPU worker binds its
    process's memory to its first core's node, which would bind the host's too)."""
    if not current_platform.is_cpu() or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        return False
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        return False
    from vllm.utils.cpu_resource_utils import get_visible_memory_node  # noqa: PLC0415  (CPU builds only)

    return len(get_visible_memory_node()) == 1


@dataclass
class EngineStart:
    """What `cpu_engine_settings` hands the engine: the extra `LLM(...)` arguments, and for a
    guest worker its global RNG state as vLLM seeded it (set aside while the host's is back)."""

    extra: dict[str, Any]
    engine_rng: dict[str, Any] | None = None


@contextmanager
def cpu_engine_settings(worker: str) -> Iterator[EngineStart]:
    """While the engine starts, on CPU (its processes inherit the environment; a setting made
    outside wins): its engine core runs in this process, and a worker in a process of its own is
    bound to all the cores this process may use (see `vllm_engine`'s docstring).

    `worker`: "own" (vLLM's "uni" executor in a process that is the engine's alone, an engine
    actor), "guest" ("uni" in a process that goes on with its own work, `worker_fits_here`) or
    "process" (a process of its own). An engine core here seeds the global RNGs and drops torch
    to one thread; a worker here replaces `torch.set_num_threads` with a no-op and sets torch's
    float32 matmul precision to vLLM's. Unless the process is the engine's own, all are put back,
    so that a trainer holding the engine keeps its own."""
    if not current_platform.is_cpu():
        yield EngineStart({})
        return
    settings = {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(os.sched_getaffinity(0)), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    settings = {k: v for k, v in settings.items() if k not in os.environ}
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") == "0"
    rng, threads, set_num_threads = rng_state(), torch.get_num_threads(), torch.set_num_threads
    precision = torch.get_float32_matmul_precision()
    os.environ.update(settings)
    start = EngineStart({"distributed_executor_backend": "uni"} if worker == "guest"
                        else {"distributed_executor_backend": "mp"} if in_process and worker == "process" else {})
    try:
        yield start
    finally:
        for key in settings:
            os.environ.pop(key, None)
        if worker != "own":
            if worker == "guest":
                start.engine_rng = rng_state()
            set_rng_state(rng)
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
            torch.set_float32_matmul_precision(precision)


@contextmanager
def keeping_the_hosts_process_group(host_has_one: bool) -> Iterator[None]:
    """While an engine core in this process shuts down: vLLM 0.32 then destroys torch's default
    process group (`cleanup_dist_env_and_memory`), its own groups' and the trainer's alike. Where
    the group was there before the engine (`host_has_one`) only vLLM's are destroyed."""
    if not (host_has_one and torch.distributed.is_initialized()):
        yield
        return
    destroy = torch.distributed.destroy_process_group

    def all_but_the_default(group=None):
        if group is not None:
            destroy(group)

    torch.distributed.destroy_process_group = all_but_the_default
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = destroy


def cpu_kv_cache(model_dir: Path, max_num_seqs: int, max_model_len: int | None) -> dict[str, int]:
    """`LLM(...)` arguments for a CPU KV cache of exactly `max_num_seqs` sequences of
    `max_model_len` tokens (the model's context length if None), in float32 blocks of
    CPU_BLOCK_SIZE tokens. The block count is what vLLM allocates; the byte size only marks
    the cache as sized, which skips vLLM's warm-up pass in eager mode."""
    config = json.loads((model_dir / "config.json").read_text())
    blocks = kv_cache_blocks(max_num_seqs, context_length(model_dir, max_model_len))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    block_bytes = kv_block_bytes(config["num_hidden_layers"], kv_heads, head_dim)
    return {"block_size": CPU_BLOCK_SIZE, "num_gpu_blocks_override": blocks, "kv_cache_memory_bytes": blocks * block_bytes}


def cpu_prefill(model_dir: Path, max_num_seqs: int, max_model_len: int | None) -> dict[str, Any]:
    """`LLM(...)` arguments that keep a CPU engine from splitting a prompt across scheduler
    steps (see `vllm_engine`'s docstring): chunked prefill off, and a step budget of vLLM's CPU
    default (CPU_PREFILL_TOKENS), at most what `max_num_seqs` sequences hold (vLLM warns above
    that) and at least one prompt of the context length and one token per sequence (vLLM
    refuses less without chunked prefill)."""
    tokens = context_length(model_dir, max_model_len)
    budget = max(tokens, max_num_seqs, min(CPU_PREFILL_TOKENS, max_num_seqs * tokens))
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": budget}


def context_length(model_dir: Path, max_model_len: int | None) -> int:
    """`max_model_len`, or the model's own context length when it is None."""
    return max_model_len or json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]


def cpu_list(cpus: set[int] | Sequence[int]) -> str:
    """`{0, 1, 2, 5}` -> "0-2,5", the form VLLM_CPU_OMP_THREADS_BIND takes."""
    ids, parts = sorted(cpus), []
    start = prev = ids[0]
    for i in [*ids[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts)
