"""Pipelined rollouts with a bound on policy lag (PipelineRL / AsyncFlow style, at chunk level).

In the synchronous loop every RL step waits for its rollouts, trains, then pushes the new
weights into the engine before the next generation starts. `RolloutPipeline` instead runs
the engine on a background thread that keeps generating the next steps' batches while the
trainer updates on the current one:

    trainer   | train s-1 | publish v=s-1 | train s   | publish v=s | ...
    producer  | generate batch s (chunks) ... apply v=s-1 ... generate batch s+1 ...

Versions: version v is the policy after v updates; the synchronous loop samples batch s with
version s - 1. Here batch s may be sampled with any version >= s - 1 - max_lag: before each
of a batch's chunks (one engine call over whole prompt groups) the producer waits until the
trainer has published at least that version and applies the newest published weights, so a
batch can mix versions (weights change "in flight", between chunks, never inside one). Each
rollout records the version that sampled it; its lag is (s - 1) - version, in [0, max_lag].
max_lag = 0 makes the producer wait for every update: the synchronous order, on a thread.

The trainer corrects for the lag with per-token truncated importance weights (see
`rlhf_core.algos.truncated_is_weights`); this module only schedules.

Threading: only the producer thread calls the engine, except inside `exclusive()`, which
holds the engine between chunks (held-out evaluation, with the newest weights applied). The
engine's work happens in its own processes, so the producer thread mostly waits on I/O and
the trainer's thread keeps the GIL for its torch ops. Not bit-reproducible: which version a
chunk sees depends on timing.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

StateDict = Mapping[str, torch.Tensor]


@dataclass
class PipelinedBatch:
    """The rollouts of one RL step, with the policy version that sampled each."""

    step: int
    rollouts: list[Any]
    versions: list[int]
    wait_s: float = 0.0  # how long `take` blocked the trainer

    def lags(self) -> list[int]:
        return [self.step - 1 - v for v in self.versions]


@dataclass
class _Shared:
    published: int  # newest version the trainer has published
    applied: int  # version the engine holds
    pending: tuple[int, StateDict] | None = None
    batches: dict[int, PipelinedBatch] = field(default_factory=dict)
    error: BaseException | None = None
    stop: bool = False
    sync_s: float = 0.0  # seconds spent applying weights since the last `take_sync_seconds`
    syncs: int = 0


class RolloutPipeline:
    """Generates batches `first_step..last_step` ahead of the trainer on a daemon thread.

    plan(step) -> the step's chunks (anything `run_chunk` understands); run_chunk(chunk) ->
    that chunk's rollouts, in order; apply_weights(state_dict) pushes weights into the engine.
    `version` is the version the engine holds at the start (first_step - 1 for a fresh run).
    """

    def __init__(
        self,
        plan: Callable[[int], Sequence[Any]],
        run_chunk: Callable[[Any], list[Any]],
        apply_weights: Callable[[StateDict], Any],
        *,
        first_step: int,
        last_step: int,
        max_lag: int,
        version: int | None = None,
    ):
        if max_lag < 0:
            raise ValueError(f"max_lag must be >= 0, got {max_lag}")
        self.plan, self.run_chunk, self.apply_weights = plan, run_chunk, apply_weights
        self.max_lag = max_lag
        version = first_step - 1 if version is None else version
        self._s = _Shared(published=version, applied=version)
        self._cond = threading.Condition()
        self._engine = threading.Lock()
        self._thread = threading.Thread(
            target=self._produce, args=(first_step, last_step), name="rollout-pipeline", daemon=True
        )
        self._thread.start()

    # ---------------------------------------------------------------- trainer side

    def take(self, step: int, timeout: float | None = None) -> PipelinedBatch:
        """Block until batch `step` is ready; if the producer failed before making it, raise."""
        start = time.perf_counter()
        with self._cond:
            ready = self._cond.wait_for(lambda: step in self._s.batches or self._s.error is not None, timeout)
            if step not in self._s.batches and self._s.error is not None:
                raise RuntimeError(f"rollout pipeline failed while generating: {self._s.error!r}") from self._s.error
            if not ready:
                raise TimeoutError(f"batch of step {step} not ready after {timeout} s")
            batch = self._s.batches.pop(step)
        batch.wait_s = time.perf_counter() - start
        return batch

    def publish(self, version: int, state_dict: StateDict, copy: bool = True) -> None:
        """Offer the weights after `version` updates; the producer applies the newest offer
        before its next chunk. Tensors are copied (the trainer keeps updating its own) unless
        `copy` is False: pass that only for a private copy nobody writes to afterwards."""
        if copy:
            state_dict = {k: v.detach().clone() for k, v in state_dict.items()}
        with self._cond:
            if version <= self._s.published:
                raise ValueError(f"version {version} published after version {self._s.published}")
            self._s.pending, self._s.published = (version, state_dict), version
            self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[int]:
        """Hold the engine between chunks, with the newest published weights applied. Yields
        the version the engine then holds."""
        with self._engine:
            self._apply_pending()
            yield self._s.applied

    def take_sync_seconds(self) -> tuple[float, int]:
        """(seconds spent applying weights, number of applications) since the last call."""
        with self._cond:
            out = (self._s.sync_s, self._s.syncs)
            self._s.sync_s, self._s.syncs = 0.0, 0
        return out

    def close(self, timeout: float = 600.0) -> None:
        """Stop after the chunk in progress; idempotent."""
        with self._cond:
            self._s.stop = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"rollout pipeline did not stop within {timeout} s")

    def __enter__(self) -> "RolloutPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- producer side

    def _produce(self, first_step: int, last_step: int) -> None:
        try:
            for step in range(first_step, last_step + 1):
                rollouts: list[Any] = []
                versions: list[int] = []
                for chunk in self.plan(step):
                    with self._cond:  # the lag bound: wait for a recent enough policy
                        self._cond.wait_for(lambda: self._s.stop or self._s.published >= step - 1 - self.max_lag)
                        if self._s.stop:
                            return
                    with self._engine:
                        self._apply_pending()
                        out = self.run_chunk(chunk)
                        version = self._s.applied
                    rollouts += out
                    versions += [version] * len(out)
                with self._cond:
                    self._s.batches[step] = PipelinedBatch(step, rollouts, versions)
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001  (handed to the trainer in `take`)
            with self._cond:
                self._s.error = exc
                self._cond.notify_all()

    def _apply_pending(self) -> None:
        """Under the engine lock: push the newest published weights, if not yet applied."""
        with self._cond:
            pending, self._s.pending = self._s.pending, None
        if pending is None:
            return
        version, state_dict = pending
        start = time.perf_counter()
        self.apply_weights(state_dict)
        seconds = time.perf_counter() - start
        with self._cond:
            self._s.applied = version
            self._s.sync_s += seconds
            self._s.syncs += 1
