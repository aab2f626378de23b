"""Rollouts from a vLLM engine that follows the trainer's weights.

`RolloutEngine` wraps `vllm.LLM` for a local Hugging Face model directory (the policy
saved by `save_pretrained_atomic`). It samples groups of responses with the logprob of
every sampled token and takes new weights in place (`sync_weights`) without restarting.
Why each rule below holds, with its measurements: docs/performance-notes.md ("Rollout engine").

Where this departs from a plain `LLM(...)`:

- dtype defaults to float32, which keeps the engine within float rounding of an fp32 trainer;
  with bf16 rollouts, use the trainer's recomputed logprobs as the "old" ones, not the engine's.
- Logprobs are "processed" (`logprobs_mode="processed_logprobs"`): the logprob of the sampled
  token under the distribution sampled from (after temperature, top-k/top-p). With top_p=1 that
  is the trainer's `log_softmax(logits / T)` (`hf_reference.recompute_logprobs(..., temperature=T)`);
  with top_p<1 it is renormalised over the nucleus, which the trainer does not reproduce. A
  greedy request (temperature 0) gets log_softmax of the unscaled logits.
- After a weight sync the prefix cache is reset: cached KV blocks hold the old weights' keys.
- On CPU the engine's worker is bound to every core this process may run on
  (`VLLM_CPU_OMP_THREADS_BIND`, unless you set it), not all but one.
- On CPU the engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, unless you
  set it) and, where that changes nothing for the process (`cpu_engine.worker_fits_here`), the
  worker too, as a guest (`cpu_engine`: the process state a guest worker swaps and restores). A
  pipelined trainer, which generates on another thread, keeps the worker in its own process
  (`guest=False`). Off CPU both are processes of vLLM's own.
- On CPU the KV cache holds exactly `max_num_seqs` sequences of `max_model_len` tokens, unless
  `kv_cache_gib` gives a size (vLLM's legacy `VLLM_CPU_KVCACHE_SPACE`, in GiB, replaces it if
  set); off CPU, without `kv_cache_gib`, vLLM sizes it from `gpu_memory_utilization`.
- On CPU a request's prompt is never split across scheduler steps (chunked prefill off): vLLM's
  CPU backend cannot sample a seeded request whose prefill was split.
- The engine returns token ids; the trainer's tokenizer decodes each response once, after
  generation (`skip_special_tokens`, as vLLM would).
- vLLM's sockets and an in-process executor's rendezvous file go to a directory of this
  process's own (`rlhf_core.vllm_scratch`), removed when its last engine closes.

vLLM starts its worker (and, off CPU, its engine core) with spawn, so a script that builds an
engine must do so under `if __name__ == "__main__":`. Always `close()` the engine (or use
`with`): it shuts the engine core down, which stops its worker processes.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm import LLM, SamplingParams
from vllm.platforms import current_platform

from rlhf_core import vllm_scratch
from rlhf_core.rng import rng_state, set_rng_state
from rlhf_core.rollout.cpu_engine import (
    cpu_engine_settings,
    cpu_kv_cache,
    cpu_prefill,
    keeping_the_hosts_process_group,
    rendezvous_in,
    worker_fits_here,
)
from rlhf_core.rollout.factory import release_cached_memory
from rlhf_core.rollout.weight_sync import SafetensorsFileTransport, WeightTransport

EXTENSION = "rlhf_core.rollout.weight_transfer.EngineWorkerExtension"
GiB = 1 << 30


@dataclass(frozen=True)
class Rollout:
    """One sampled response. `group` is the index of its prompt in the `generate` call (for
    GRPO's per-prompt baselines); `index` numbers the `n` samples of that prompt."""

    group: int
    index: int
    prompt: str
    prompt_token_ids: list[int]  # starts with <s>
    response_token_ids: list[int]  # ends with </s> when finish_reason == "stop"
    response_text: str  # special tokens removed
    logprobs: list[float]  # one per response token, see the module docstring
    finish_reason: str  # "stop" (</s>) or "length" (max_tokens)


def prompt_seeds(seed: int, count: int) -> list[int]:
    """A seed for each of `count` prompts sampled under `seed` (>= 0), drawn from numpy's
    SeedSequence of (seed, position). They are 62-bit, so the seed + i of a prompt's i-th
    sample is unlikely to run into another prompt's range: in a run of 1,000 calls of 256
    prompts with 8 samples each, the chance of any overlap is about 1 in 8 million.

    One seed for a whole batch would give the i-th sample of every prompt the same random
    numbers (vLLM seeds each request's own generator): prompts whose next-token
    distributions are alike would then sample alike. And the seeds of consecutive calls
    (seed, seed + 1) would overlap in all but one sample."""
    if seed < 0:
        raise ValueError(f"generate: seed must be >= 0, got {seed}")
    return [int(np.random.SeedSequence([seed, j]).generate_state(1, np.uint64)[0] >> 2) for j in range(count)]


class RolloutEngine:
    """A vLLM engine on a local HF model directory, with in-place weight updates."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int | None = None,
        kv_cache_gib: float | None = None,
        enforce_eager: bool = True,
        gpu_memory_utilization: float = 0.5,
        max_num_seqs: int = 256,
        transport: WeightTransport | None = None,
        sleep_mode: bool = False,
        tensor_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        guest: bool = True,
    ):
        """max_num_seqs: sequences decoded together; give it the largest `generate` batch
        (prompts x n) so that a batch runs in one wave. kv_cache_gib: a KV cache size; by
        default on CPU exactly `max_num_seqs` sequences of `max_model_len`, off CPU vLLM's
        sizing from gpu_memory_utilization (the fraction of device memory). sleep_mode: `release`
        gives the engine's GPU memory back between a batch's generation and the next sync (vLLM's
        sleep mode, CUDA only). tensor_parallel_size > 1 splits the model over that many devices;
        `distributed_executor_backend` "ray" starts those workers as Ray actors in the current
        placement group (`engine_group.EngineGroup`); "uni": the model here (an engine actor); None: vLLM's,
        except that on CPU the worker runs in this process where it fits (`worker_fits_here`), unless
        not `guest`: a caller that generates on another thread while it computes (pipelined rollouts)
        gives it a process of its own."""
        if sleep_mode and current_platform.is_cpu():
            raise ValueError("policy.rollout.sleep: vLLM's CPU backend has no sleep mode; set it false (or null)")
        start = time.perf_counter()
        self.model_dir = Path(model_dir)
        self.max_model_len = max_model_len
        self.transport = transport or SafetensorsFileTransport()
        self.llm: LLM | None = None
        self.sleep_mode, self.asleep = sleep_mode, False
        self._scratch: Path | None = None
        # torch's default process group before the engine: the host's (a trainer's), kept at close
        self._hosts_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        worker = ("own" if distributed_executor_backend == "uni" else
                  "guest" if distributed_executor_backend is None and guest and worker_fits_here() else "process")
        self.worker = worker  # where its worker runs, on CPU: "own", "guest" (see above), "process"
        self._engine_rng: dict[str, Any] | None = None  # a guest's RNG state, set aside between its calls
        try:
            with (vllm_scratch.engine_start() as self._scratch, rendezvous_in(self._scratch),
                  cpu_engine_settings(worker) as started):
                extra = started.extra
                if kv_cache_gib is not None:
                    extra["kv_cache_memory_bytes"] = int(kv_cache_gib * GiB)
                elif current_platform.is_cpu():
                    extra.update(cpu_kv_cache(self.model_dir, max_num_seqs, max_model_len))
                if current_platform.is_cpu():
                    extra.update(cpu_prefill(self.model_dir, max_num_seqs, max_model_len))
                extra.update(self.transport.engine_args())
                if sleep_mode:
                    extra["enable_sleep_mode"] = True
                if distributed_executor_backend is not None:  # the caller's choice over the CPU default ("mp")
                    extra["distributed_executor_backend"] = distributed_executor_backend
                self.llm = LLM(
                    model=str(self.model_dir),
                    dtype=dtype,
                    seed=seed,
                    max_model_len=max_model_len,
                    enforce_eager=enforce_eager,
                    gpu_memory_utilization=gpu_memory_utilization,
                    max_num_seqs=max_num_seqs,
                    logprobs_mode="processed_logprobs",
                    worker_extension_cls=EXTENSION,
                    tensor_parallel_size=tensor_parallel_size,
                    **extra,
                )
            self._engine_rng = started.engine_rng
            self.tokenizer = self.llm.get_tokenizer()
        except BaseException:
            self.close()  # stops a started engine core, and closes the transport
            raise
        self.start_seconds = time.perf_counter() - start
        self.last_metrics: dict[str, float] = {"rollout/engine_start_s": self.start_seconds}

    def generate(
        self,
        prompts: Sequence[str],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 16,
        seed: int | None = None,
        min_tokens: int = 0,
        seeds: Sequence[int] | None = None,
    ) -> list[Rollout]:
        """`n` responses for each prompt, grouped by prompt in input order.

        temperature 0 is greedy. With `seed` the samples are reproducible, and no two draw the
        same random numbers: each prompt gets a seed of its own (`prompt_seeds`) and vLLM gives
        the i-th of its n samples that seed + i. Without `seed` they follow the engine's
        generator. `seeds` gives each prompt's seed instead (an engine group hands each engine
        its prompts' seeds of the whole batch: the samples do not depend on how the batch was
        split). `min_tokens` keeps </s> from ending a response earlier (benchmarks fix the length).
        """
        if self.asleep:
            raise RuntimeError("the rollout engine sleeps (its weights were released) until the next sync_weights")
        if seeds is not None and (seed is not None or len(seeds) != len(prompts)):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts (and seed={seed}): give "
                             "one seed a prompt, or `seed` alone")
        if seeds is None:
            seeds = [None] * len(prompts) if seed is None else prompt_seeds(seed, len(prompts))
        params = [
            SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, min_tokens=min_tokens,
                           seed=s, logprobs=0, detokenize=False)
            for s in seeds
        ]
        start = time.perf_counter()
        with self._own_rng():
            outputs = self._engine().generate(list(prompts), params, use_tqdm=False)
        seconds = time.perf_counter() - start
        completions = [(group, out, c) for group, out in enumerate(outputs) for c in sorted(out.outputs, key=lambda c: c.index)]
        texts = self.tokenizer.batch_decode([list(c.token_ids) for _, _, c in completions], skip_special_tokens=True)
        rollouts = [
            Rollout(
                group=group,
                index=c.index,
                prompt=out.prompt,
                prompt_token_ids=list(out.prompt_token_ids),
                response_token_ids=list(c.token_ids),
                response_text=text,
                # logprobs=0 still returns the sampled token's entry at every position
                logprobs=[step[token].logprob for token, step in zip(c.token_ids, c.logprobs, strict=True)],
                finish_reason=str(c.finish_reason),
            )
            for (group, out, c), text in zip(completions, texts, strict=True)
        ]
        tokens = sum(len(r.response_token_ids) for r in rollouts)
        self.last_metrics.update(
            {"rollout/gen_s": seconds, "rollout/gen_tokens": tokens, "rollout/tokens_per_s": tokens / seconds}
        )
        return rollouts

    def probe(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]) -> list[list[list[float]]]:
        """What the engine's weights say about fixed tokens: the log-probs (temperature 1, the raw
        distribution) of each row's `response_ids` after its `prompt_ids`, teacher-forced, as one
        list for this one engine (an `EngineGroup` gives one per engine). Nothing is sampled:
        the engine's generator is not touched."""
        from vllm.inputs import TokensPrompt  # noqa: PLC0415

        if self.asleep:  # its weights are released: vLLM would read memory it no longer maps
            raise RuntimeError("the rollout engine sleeps (its weights were released) until the next sync_weights")

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        rows = [TokensPrompt(prompt_token_ids=[*p, *r]) for p, r in zip(prompt_ids, response_ids, strict=True)]
        with self._own_rng():
            outputs = self._engine().generate(rows, params, use_tqdm=False)
        return [[[step[token].logprob for token, step in zip(r, out.prompt_logprobs[len(p):], strict=True)]
                 for p, r, out in zip(prompt_ids, response_ids, outputs, strict=True)]]

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor] | torch.nn.Module) -> float:
        """Replace the engine's weights in place with `state_dict` (Hugging Face names, as from
        `model.state_dict()`), or, through a streaming transport, with the trainer's module read
        one parameter at a time (`weight_transfer.ModuleSource`). Returns the seconds taken, also
        in `last_metrics`."""
        llm = self._engine()
        start = time.perf_counter()
        woke = 0.0
        if self.asleep:  # as verl and OpenRLHF wake a colocated engine: weights first, then the cache
            release_cached_memory()  # the trainer's cached blocks, which the waking engine maps again
            llm.wake_up(tags=["weights"])
            woke = time.perf_counter() - start
        self.transport.push(llm, state_dict)
        if self.asleep:
            wake = time.perf_counter()
            llm.wake_up(tags=["kv_cache"])
            self.asleep = False
            self.last_metrics["rollout/wake_s"] = woke + time.perf_counter() - wake
        llm.reset_prefix_cache()
        seconds = time.perf_counter() - start
        self.last_metrics["rollout/sync_s"] = seconds
        return seconds

    def release(self) -> None:
        """With sleep_mode, free the engine's GPU memory (weights and KV cache, vLLM's level-2 sleep:
        the weights are not kept, the next `sync_weights` brings new ones) for the trainer's update;
        `generate` refuses until that sync. Without sleep_mode, nothing."""
        if not self.sleep_mode or self.asleep:
            return
        start = time.perf_counter()
        self._engine().sleep(level=2)
        self.asleep = True
        self.last_metrics["rollout/sleep_s"] = time.perf_counter() - start

    def close(self, timeout: float = 30.0) -> None:
        """Shut the engine core down, which stops its worker processes. Idempotent.

        vLLM's default grace period is 5 s, after which it SIGKILLs the engine core and
        leaves it unreaped (a zombie); on a loaded CPU machine the worker alone can take most
        of that to exit, so we give `timeout` seconds and then reap the processes.
        """
        llm, self.llm = self.llm, None
        try:
            if llm is not None:
                client = llm.llm_engine.engine_core
                with keeping_the_hosts_process_group(self._hosts_group):
                    client.shutdown(timeout=timeout)
                manager = getattr(getattr(client, "resources", None), "engine_manager", None)
                for proc in getattr(manager, "processes", []):
                    proc.join(timeout=5)
        finally:
            self.transport.close()
            scratch, self._scratch = self._scratch, None
            vllm_scratch.engine_closed(scratch)

    @contextmanager
    def _own_rng(self) -> Iterator[None]:
        """While a guest worker samples: the global RNGs are its own, as in a process of its own
        (an unseeded request draws from them), and the host's are put back after."""
        if self._engine_rng is None:
            yield
            return
        host = rng_state()
        set_rng_state(self._engine_rng)
        try:
            yield
        finally:
            self._engine_rng = rng_state()
            set_rng_state(host)

    def _engine(self) -> LLM:
        if self.llm is None:
            raise RuntimeError("the rollout engine is closed")
        return self.llm

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
