"""A stand-in for the colocated rollout engine where vLLM is not installed (the GPU check's
machine): the engine's verbs (`rlhf_core.rollout.factory.Engine`) answered by a Hugging Face
model in a process of its own, as vLLM's engine core is one on a GPU.

What it keeps of the real engine: every call crosses the process boundary as msgpack, as the
engine core's calls do (no pickle, so a payload msgpack cannot carry fails here as it would
there); the model is loaded in the engine's dtype (bf16 on a GPU) on the trainer's device; and
on a GPU the weights cross as CUDA IPC handles in the wire form the real sync sends
(`rlhf_core.rollout.ipc_wire.handles_to_wire`), rebuilt in the engine's process from that form
(`handles_from_wire`) and opened by torch's `rebuild_cuda_tensor`, which is what vLLM's IPC
receiver calls, then loaded into the model. On the CPU they cross as bytes in the same messages.
What it does not keep: vLLM's kernels, scheduler, packed staging buffer and sleep mode. Sampling
is `generate`, its log-probs those of the distribution sampled from (vLLM's processed log-probs).

`bench/gpu_loops.py` puts it behind the policy stage's front door (`policy_rollouts.open_engine`).
"""
from __future__ import annotations

import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch

from rlhf_core.models.lora import is_lora_model, merged_weights
from rlhf_core.models.placement import is_partitioned, module_entries
from rlhf_core.rollout.factory import engine_settings
from rlhf_core.rollout.ipc_wire import handles_from_wire, handles_to_wire

GPU_KEY = "trainer-gpu"  # the handles' key, where vLLM keys them by the GPU's UUID
CHUNK_BYTES = 256 << 20  # weights copied, handed over and released per message


@dataclass(frozen=True)
class Rollout:
    """What `policy_rollouts` reads of a vLLM engine's rollout."""

    group: int
    index: int
    prompt: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_text: str
    logprobs: list[float]
    finish_reason: str


def open_stand_in(model_dir: str | Path, rollout, *, precision: str, device: torch.device, seed: int,
                  max_model_len: int, **_) -> StandInEngine:
    """`rollout.factory.open_engine`'s signature: the stand-in in the dtype the real engine would get."""
    return StandInEngine(model_dir, dtype=engine_settings(rollout, precision, device.type)["dtype"], device=device,
                         seed=seed, max_model_len=max_model_len)


class StandInEngine:
    def __init__(self, model_dir: str | Path, *, dtype: str, device: torch.device, seed: int, max_model_len: int):
        ctx = torch.multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, str(model_dir), dtype, str(device), seed), daemon=True)
        self.process.start()
        start = time.perf_counter()
        self.dtype, self.device, self.max_model_len = getattr(torch, dtype), device, max_model_len
        self._call("ready")
        self.last_metrics: dict[str, float] = {"rollout/engine_start_s": time.perf_counter() - start}

    def _call(self, verb: str, *args):
        self.conn.send_bytes(msgpack.packb([verb, list(args)]))
        status, value = msgpack.unpackb(self.conn.recv_bytes())
        if status != "ok":
            raise RuntimeError(f"stand-in engine: {verb} failed in the engine's process:\n{value}")
        return value

    def generate(self, prompts: Sequence[str], n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 max_tokens: int = 16, seed: int | None = None) -> list[Rollout]:
        start = time.perf_counter()
        rows = self._call("generate", list(prompts), n, temperature, top_p, max_tokens, seed)
        rollouts = [Rollout(*row) for row in rows]
        seconds = time.perf_counter() - start
        tokens = sum(len(r.response_token_ids) for r in rollouts)
        self.last_metrics.update({"rollout/gen_s": seconds, "rollout/gen_tokens": tokens,
                                  "rollout/tokens_per_s": tokens / seconds})
        return rollouts

    def probe(self, prompt_ids, response_ids) -> list[list[list[float]]]:
        return [self._call("probe", [list(p) for p in prompt_ids], [list(r) for r in response_ids])]

    def sync_weights(self, weights: Mapping[str, torch.Tensor] | torch.nn.Module) -> float:
        """The trainer's weights (a state dict, or its module: gathered one parameter at a time under
        ZeRO-3, merged one weight at a time with LoRA) into the engine's model, in chunks."""
        start, chunk, size = time.perf_counter(), [], 0
        for name, tensor in _wire_copies(weights, self.dtype, self.device):
            chunk.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= CHUNK_BYTES:
                self._load(chunk)
                chunk, size = [], 0
        if chunk:
            self._load(chunk)
        seconds = time.perf_counter() - start
        self.last_metrics["rollout/sync_s"] = seconds
        return seconds

    def _load(self, chunk: list[tuple[str, torch.Tensor]]) -> None:
        if self.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor  # noqa: PLC0415

            torch.cuda.current_stream(self.device).synchronize()  # the copies are written before the engine reads
            entries = [[name, handles_to_wire({GPU_KEY: reduce_tensor(t)[1]})] for name, t in chunk]
            self._call("load_ipc", entries)  # returns once the engine has copied every tensor out
            chunk.clear()
            torch.cuda.ipc_collect()
        else:
            self._call("load_bytes", [[name, str(t.dtype).removeprefix("torch."), list(t.shape),
                                       t.contiguous().view(torch.uint8).numpy().tobytes()] for name, t in chunk])

    def release(self) -> None:  # no sleep mode: the stand-in keeps its memory
        pass

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._call("close")
            except (EOFError, OSError):
                pass
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


def _wire_copies(weights, dtype: torch.dtype, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, a copy in the engine's dtype on `device`) of each tensor the engine loads, each copy made
    while its parameter is gathered (ZeRO-3)."""
    def copy(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device=device, dtype=dtype if t.is_floating_point() else t.dtype, copy=True)

    if isinstance(weights, Mapping):
        items = weights.items()
    elif is_lora_model(weights):
        items = merged_weights(weights, tied_once=True)
    else:
        items = module_entries(weights)
    for name, tensor in items:
        if is_partitioned(tensor):
            import deepspeed  # noqa: PLC0415

            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
                yield name, copy(tensor)
        else:
            yield name, copy(tensor)


# ----------------------------------------------------------------------------- the engine's process


def _serve(conn, model_dir: str, dtype: str, device: str, seed: int) -> None:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from rlhf_core.tokenizer import load_tokenizer  # noqa: PLC0415

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    engine = _Engine(model, load_tokenizer(model_dir), torch.device(device))
    while True:
        verb, args = msgpack.unpackb(conn.recv_bytes())
        try:
            value = None if verb in ("ready", "close") else getattr(engine, verb)(*args)
            conn.send_bytes(msgpack.packb(["ok", value]))
        except Exception:  # noqa: BLE001 - said to the trainer, which raises it
            conn.send_bytes(msgpack.packb(["error", traceback.format_exc()]))
        if verb == "close":
            return


class _Engine:
    def __init__(self, model, tokenizer, device: torch.device):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.tensors = model.state_dict()  # by name; a tied head shares the embeddings' tensor

    @torch.no_grad()
    def generate(self, prompts, n, temperature, top_p, max_tokens, seed):
        rows, eos = [], self.tokenizer.eos_token_id
        for group, prompt in enumerate(prompts):
            ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"].to(self.device)
            if seed is not None:
                torch.manual_seed(seed + group)
            sample = temperature > 0
            out = self.model.generate(ids.repeat(n, 1), do_sample=sample, temperature=temperature if sample else None,
                                      top_p=top_p if sample else None, top_k=None, max_new_tokens=max_tokens,
                                      output_scores=True, return_dict_in_generate=True, pad_token_id=eos,
                                      eos_token_id=eos)
            steps = torch.stack(out.scores, dim=1).float().log_softmax(-1)  # (n, new, vocab): the distribution sampled
            new = out.sequences[:, ids.shape[1]:]
            for index in range(n):
                tokens = new[index].tolist()
                stop = tokens.index(eos) + 1 if eos in tokens else len(tokens)
                tokens = tokens[:stop]
                logprobs = steps[index, torch.arange(stop), new[index, :stop]].tolist()
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                rows.append([group, index, prompt, ids[0].tolist(), tokens, text, logprobs,
                             "stop" if eos in tokens else "length"])
        return rows

    @torch.no_grad()
    def probe(self, prompt_ids, response_ids):
        out = []
        for p, r in zip(prompt_ids, response_ids, strict=True):
            ids = torch.tensor([[*p, *r]], device=self.device)
            logprobs = self.model(ids).logits[0, len(p) - 1 : len(p) + len(r) - 1].float().log_softmax(-1)
            out.append(logprobs[torch.arange(len(r)), torch.tensor(r, device=self.device)].tolist())
        return out

    @torch.no_grad()
    def load_ipc(self, entries):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor  # noqa: PLC0415

        for name, wire in entries:
            self.tensors[name].copy_(rebuild_cuda_tensor(*handles_from_wire(wire)[GPU_KEY]))
        torch.cuda.synchronize(self.device)  # copied out before the trainer lets the memory go

    @torch.no_grad()
    def load_bytes(self, entries):
        for name, dtype, shape, data in entries:
            value = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
            self.tensors[name].copy_(value)
