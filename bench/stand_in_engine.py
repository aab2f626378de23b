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
It sleeps during the update as a colocated engine on a GPU does (weights and a KV cache of the
size the engine's share is sized for handed back to the device; before it wakes the trainer hands
its cached blocks back, `rollout.factory.release_cached_memory`), and says how much of the device
was free when it woke. What it does not keep: vLLM's kernels, scheduler and packed staging buffer.
Sampling is `generate`, its log-probs those of the distribution sampled from (vLLM's processed
log-probs).

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
from rlhf_core.models.placement import module_entries
from rlhf_core.models.engine_share import MARGIN, kv_bytes_per_token
from rlhf_core.rollout.factory import engine_settings, engine_sleeps, release_cached_memory
from rlhf_core.rollout.ipc_wire import handles_from_wire, handles_to_wire
from rlhf_core.rollout.weight_sync import gathered

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
                  max_num_seqs: int, max_model_len: int, pipelined: bool, **_) -> StandInEngine:
    """`rollout.factory.open_engine`'s signature: the stand-in in the dtype the real engine would
    get, with a KV cache of the size the engine's share is sized for (`models.engine_share`:
    `MARGIN` x a step's rollouts x its context), sleeping during the update as a colocated
    engine on a GPU does (here also on the CPU, so that a dry run takes the same turns)."""
    dtype = engine_settings(rollout, precision, device.type)["dtype"]
    from transformers import AutoConfig  # noqa: PLC0415

    c = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = MARGIN * kv_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, head_dim,
                                     torch.tensor([], dtype=getattr(torch, dtype)).element_size())
    return StandInEngine(model_dir, dtype=dtype, device=device, seed=seed, max_model_len=max_model_len,
                         kv_cache_bytes=int(kv * max_num_seqs * max_model_len),
                         sleep_mode=engine_sleeps(rollout, pipelined, "cuda"))


class StandInEngine:
    def __init__(self, model_dir: str | Path, *, dtype: str, device: torch.device, seed: int, max_model_len: int,
                 kv_cache_bytes: int = 0, sleep_mode: bool = False):
        ctx = torch.multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, str(model_dir), dtype, str(device), seed,
                                                        kv_cache_bytes), daemon=True)
        self.process.start()
        start = time.perf_counter()
        self.dtype, self.device, self.max_model_len = getattr(torch, dtype), device, max_model_len
        self.sleep_mode, self.asleep = sleep_mode, False
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
        if self.asleep:
            raise RuntimeError("the rollout engine sleeps (its weights were released) until the next sync_weights")
        start = time.perf_counter()
        rows = self._call("generate", list(prompts), n, temperature, top_p, max_tokens, seed)
        rollouts = [Rollout(*row) for row in rows]
        seconds = time.perf_counter() - start
        tokens = sum(len(r.response_token_ids) for r in rollouts)
        self.last_metrics.update({"rollout/gen_s": seconds, "rollout/gen_tokens": tokens,
                                  "rollout/tokens_per_s": tokens / seconds})
        return rollouts

    def probe(self, prompt_ids, response_ids) -> list[list[list[float]]]:
        if self.asleep:
            raise RuntimeError("the rollout engine sleeps (its weights were released) until the next sync_weights")
        return [self._call("probe", [list(p) for p in prompt_ids], [list(r) for r in response_ids])]

    def sync_weights(self, weights: Mapping[str, torch.Tensor] | torch.nn.Module) -> float:
        """The trainer's weights (a state dict, or its module: gathered one parameter at a time under
        ZeRO-3, merged one weight at a time with LoRA) into the engine's model, in chunks. Asleep, as
        `vllm_engine.RolloutEngine` wakes: the trainer's cached blocks handed back, the weights' memory
        mapped again, the weights loaded, then the KV cache's."""
        start, chunk, size = time.perf_counter(), [], 0
        if self.asleep:
            release_cached_memory()
            free = self._call("wake", "weights")
            if free is not None:
                self.last_metrics["rollout/free_at_wake_gib"] = free / 2**30
        for name, tensor in _wire_copies(weights, self.dtype, self.device):
            chunk.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= CHUNK_BYTES:
                self._load(chunk)
                chunk, size = [], 0
        if chunk:
            self._load(chunk)
        if self.asleep:
            self._call("wake", "kv_cache")
            self.asleep = False
            self.last_metrics["rollout/wake_s"] = time.perf_counter() - start
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

    def release(self) -> None:
        """With sleep mode, the engine's weights and KV cache handed back to the device (vLLM's
        level-2 sleep) until the next `sync_weights`."""
        if self.sleep_mode and not self.asleep:
            start = time.perf_counter()
            self._call("sleep")
            self.asleep = True
            self.last_metrics["rollout/sleep_s"] = time.perf_counter() - start

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
    return gathered(items, copy)


# ----------------------------------------------------------------------------- the engine's process


def _serve(conn, model_dir: str, dtype: str, device: str, seed: int, kv_cache_bytes: int) -> None:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from rlhf_core.tokenizer import load_tokenizer  # noqa: PLC0415

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    engine = _Engine(model, load_tokenizer(model_dir), torch.device(device), kv_cache_bytes)
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
    def __init__(self, model, tokenizer, device: torch.device, kv_cache_bytes: int):
        self.model, self.tokenizer, self.device, self.kv_cache_bytes = model, tokenizer, device, kv_cache_bytes
        # by name, every name of a tied tensor; a sleep gives the parameters' memory back (the buffers
        # are small, and the non-persistent ones, rotary frequencies, are not in what a sync sends)
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.tensors = self.params | dict(model.named_buffers())
        self.shapes = {name: t.shape for name, t in self.params.items()}
        self.kv_cache = torch.empty(kv_cache_bytes, dtype=torch.uint8, device=device)  # what a step's KV holds

    def sleep(self):
        for t in self.params.values():
            t.data = torch.empty(0, dtype=t.dtype, device=self.device)
        self.kv_cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self, tags: str):
        """Map the weights' memory again (their values come with the sync) or the KV cache's -> the
        device's free bytes before (None off CUDA)."""
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        if tags == "weights":
            for name, t in self.params.items():
                if t.shape != self.shapes[name]:  # a tied tensor is mapped once
                    t.data = torch.empty(self.shapes[name], dtype=t.dtype, device=self.device)
        else:
            self.kv_cache = torch.empty(self.kv_cache_bytes, dtype=torch.uint8, device=self.device)
        return free

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
            self.tensors[name].data.copy_(rebuild_cuda_tensor(*handles_from_wire(wire)[GPU_KEY]))
        torch.cuda.synchronize(self.device)  # copied out before the trainer lets the memory go

    @torch.no_grad()
    def load_bytes(self, entries):
        for name, dtype, shape, data in entries:
            value = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
            self.tensors[name].data.copy_(value)
