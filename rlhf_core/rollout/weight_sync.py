"""Moving the trainer's weights into a running vLLM engine, in place.

Two halves:

- `WeightSyncExtension`, named by qualified name in `LLM(worker_extension_cls=...)`. vLLM
  imports it inside every spawned worker process and appends it to the worker's bases, so
  `llm.collective_rpc("rlhf_load_weights_file", args=(path,))` calls it by name. Sending a
  name instead of a pickled function is what lets us leave
  `VLLM_ALLOW_INSECURE_SERIALIZATION` unset. vLLM refuses an extension attribute that
  the worker class already has, hence the `rlhf_` prefix (the worker has `reload_weights`).
- A `WeightTransport` that gets the tensors to the workers and makes them load them.
  `RolloutEngine.sync_weights` only talks to this interface.

The load goes through `Worker.reload_weights(weights_iterator=...)`, the model runner's
in-place reload: it runs the model's own `load_weights` (so Hugging Face names such as
`q_proj`/`k_proj`/`v_proj` are fused into vLLM's `qkv_proj`) and then re-runs the
post-load processing. Calling `model.load_weights` directly does not work on the CPU
backend, which repacks linear weights after loading.

Transports:

- `SafetensorsFileTransport` (implemented, used on CPU): the trainer writes one
  safetensors file atomically into a private directory, on /dev/shm (RAM) when it exists,
  and sends only its path; each worker reads it back. One write and one read per sync,
  small next to a generation step for models that fit on a CPU.
- `weight_transfer.StreamingTransport`: no files; the tensors are broadcast to the workers
  through vLLM's weight-transfer API (NCCL to engines on GPUs of their own, gloo on CPU), one
  at a time.
- `ipc_transfer.IpcTransport`: no files; a colocated engine on rank 0's GPU maps the tensors
  from a staging buffer by CUDA IPC, through the same API (NCCL refuses two ranks on one GPU).
"""
from __future__ import annotations

import concurrent.futures
import os
import shutil
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from rlhf_core.models.placement import is_partitioned

WEIGHTS_FILE = "weights.safetensors"


class WeightSyncExtension:
    """Mixed into each vLLM worker (`self` is the worker). Methods run in the worker process."""

    def rlhf_load_weights_file(self, path: str) -> int:
        """Load Hugging Face-named tensors from a safetensors file, in place. Returns how many."""
        from safetensors.torch import load_file

        weights = load_file(path, device="cpu")
        self.reload_weights(weights_iterator=iter(weights.items()))  # type: ignore[attr-defined]
        repack_tied_head(self.model_runner.model)  # type: ignore[attr-defined]
        return len(weights)


def repack_tied_head(model: Any) -> None:
    """Process a tied LM head again after its embeddings changed.

    vLLM's CPU backend packs every linear weight for its GEMM kernels once the weights are
    loaded, the LM head included. A reload repacks the modules whose weights it loaded; a tied
    head loads none of its own (its weight is the embeddings'), so without this it keeps
    computing logits with the packed copy of the first weights (measured: log-probs off by
    more than 1 nat after one sync of a tied Llama or Qwen2)."""
    head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    if head is None or not getattr(text, "tie_word_embeddings", False):
        return
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)


class WeightSyncTimeout(RuntimeError):
    """A weight sync did not finish in time; the engine cannot take weights any more."""


def on_daemon_thread(work, name: str = "weight-sync") -> concurrent.futures.Future:
    """`work()` started on a daemon thread; its result or error in the returned future. Not a
    ThreadPoolExecutor: Python joins those threads at exit, so one stuck in a transfer that
    never completes would keep the process from ever exiting."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(work())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            done.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


def within_timeout(work, timeout_s: float, message) -> None:
    """Run `work()` on a daemon thread and wait `timeout_s` for it: its error is raised here, and
    `WeightSyncTimeout(message())` when it is still running then (the thread is left behind: a
    collective cannot be cancelled, and the process is about to fail its stage)."""
    try:
        on_daemon_thread(work).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise WeightSyncTimeout(message()) from None


class WeightTransport(ABC):
    """Delivers a state dict to every worker of a running engine and has it loaded."""

    @abstractmethod
    def push(self, llm: Any, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Return once every worker has loaded `state_dict` (Hugging Face parameter names)."""

    def engine_args(self) -> dict[str, Any]:
        """Extra `LLM(...)` arguments the engine needs for this transport."""
        return {}

    def close(self) -> None:
        """Release what the transport holds (files, process groups)."""


def _default_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def without_tied_copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors with each shared storage named once, by its first name: a model with tied
    embeddings holds `lm_head.weight` as a view of `model.embed_tokens.weight`; safetensors
    refuses to write both, and vLLM loads a tied head from the embeddings."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = {}
    for name, t in tensors.items():
        key = (t.data_ptr(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out[name] = t
    return out


class SafetensorsFileTransport(WeightTransport):
    """CPU transport: one safetensors file in a private temporary directory, passed by path.

    The file is written under a temporary name and renamed into place, so a worker never
    reads a half-written file. `directory` defaults to /dev/shm (RAM-backed) when writable,
    else the system temporary directory.
    """

    def __init__(self, directory: str | os.PathLike | None = None, timeout_s: float = 300.0):
        self.dir = Path(tempfile.mkdtemp(prefix="rlhf-weights-", dir=directory or _default_dir()))
        self.timeout_s = timeout_s

    def push(self, llm: Any, state_dict: Mapping[str, torch.Tensor]) -> None:
        if isinstance(state_dict, torch.nn.Module):
            raise TypeError("the file transport takes a state dict, not a module (only a streaming transport reads "
                            "the trainer's module itself)")
        within_timeout(lambda: self._push(llm, state_dict), self.timeout_s, lambda: (
            f"weight sync (file) did not finish within {self.timeout_s:g} s (policy.rollout.sync_timeout_s)"))

    def _push(self, llm: Any, state_dict: Mapping[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        path = self.dir / WEIGHTS_FILE
        tmp = path.with_name(path.name + ".tmp")
        tensors = without_tied_copies({name: t.detach().to("cpu").contiguous() for name, t in state_dict.items()})
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
        loaded = llm.collective_rpc("rlhf_load_weights_file", args=(str(path),))
        if any(n != len(tensors) for n in loaded):
            raise RuntimeError(f"workers loaded {loaded} tensors, expected {len(tensors)}")

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def gathered(entries: Iterable[tuple[str, torch.Tensor]],
             convert: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, `convert`(tensor)) of each of `entries`, a ZeRO-3 parameter gathered (a collective:
    every rank walks the same entries) only while it is converted and its result taken; `convert`
    must copy, since a gathered parameter's memory goes back to DeepSpeed when its gather ends."""
    for name, tensor in entries:
        if is_partitioned(tensor):
            import deepspeed  # noqa: PLC0415 - only a ZeRO-3 module has partitioned parameters

            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
                yield name, convert(tensor)  # taken before the generator resumes and releases it
        else:
            yield name, convert(tensor)
