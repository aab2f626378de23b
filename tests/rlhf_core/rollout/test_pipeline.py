"""RolloutPipeline's scheduling: the lag bound, weights in flight, errors, shutdown.

The engine here is a stand-in that records which weights it held for each chunk: what is
under test is the ordering between the producer thread and the trainer, which does not
depend on what the engine computes. The real vLLM engine runs under the pipeline in
tests/rlhf_core/distributed/test_policy_trainer.py (pipelined GRPO run).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from rlhf_core.rollout.pipeline import RolloutPipeline


class Engine:
    """Holds a scalar 'weight'; a chunk's rollouts carry the weight they were sampled with."""

    def __init__(self, delay: float = 0.0):
        self.weight = 0.0
        self.delay = delay
        self.calls: list[tuple[int, int, float]] = []
        self.lock = threading.Lock()

    def apply(self, state_dict):
        self.weight = float(state_dict["w"])

    def run(self, chunk):
        step, index = chunk
        time.sleep(self.delay)
        with self.lock:
            self.calls.append((step, index, self.weight))
        return [(step, index, self.weight)] * 2  # two rollouts per chunk


def weights(version: int) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(float(version))}


def pipeline(engine: Engine, steps: int, max_lag: int, chunks: int = 2, first_step: int = 1) -> RolloutPipeline:
    return RolloutPipeline(
        lambda step: [(step, i) for i in range(chunks)], engine.run, engine.apply,
        first_step=first_step, last_step=steps, max_lag=max_lag,
    )


def train(pipe: RolloutPipeline, steps: int, seconds: float = 0.0, first_step: int = 1):
    """The trainer's side: take batch s, 'train', publish version s."""
    batches = []
    for step in range(first_step, steps + 1):
        batches.append(pipe.take(step, timeout=30))
        time.sleep(seconds)
        pipe.publish(step, weights(step))
    return batches


def test_max_lag_zero_samples_every_batch_with_the_latest_policy():
    engine = Engine(delay=0.01)
    with pipeline(engine, steps=5, max_lag=0) as pipe:
        batches = train(pipe, 5, seconds=0.02)
    for batch in batches:
        assert batch.versions == [batch.step - 1] * 4
        assert batch.lags() == [0] * 4
        # the engine really held those weights when it sampled
        assert [w for _, _, w in batch.rollouts] == [batch.step - 1.0] * 4


@pytest.mark.parametrize("max_lag", [1, 2, 3])
def test_lag_never_exceeds_the_bound_and_a_slow_trainer_reaches_it(max_lag):
    engine = Engine()
    with pipeline(engine, steps=8, max_lag=max_lag) as pipe:
        batches = train(pipe, 8, seconds=0.05)  # the producer is far faster: it runs ahead
    lags = [lag for b in batches for lag in b.lags()]
    assert min(lags) >= 0 and max(lags) == max_lag
    for b in batches:  # the recorded version is the weight the engine held
        assert [w for _, _, w in b.rollouts] == [float(v) for v in b.versions]


def test_weights_change_in_flight_between_the_chunks_of_one_batch():
    engine = Engine()
    first_chunk_of_step_2 = threading.Event()
    published_v1 = threading.Event()

    def run(chunk):
        if chunk == (2, 0):
            first_chunk_of_step_2.set()
            assert published_v1.wait(10)
        return engine.run(chunk)

    pipe = RolloutPipeline(lambda s: [(s, 0), (s, 1)], run, engine.apply, first_step=1, last_step=2, max_lag=1)
    with pipe:
        assert pipe.take(1, timeout=10).versions == [0, 0, 0, 0]
        assert first_chunk_of_step_2.wait(10)  # batch 2 started on version 0, before step 1 trained
        pipe.publish(1, weights(1))
        published_v1.set()
        batch = pipe.take(2, timeout=10)
    assert batch.versions == [0, 0, 1, 1]
    assert batch.lags() == [1, 1, 0, 0]
    assert pipe.take_sync_seconds()[1] == 1


def test_exclusive_holds_the_engine_with_the_newest_weights():
    engine = Engine()
    with pipeline(engine, steps=3, max_lag=0) as pipe:
        pipe.take(1, timeout=10)
        pipe.publish(1, weights(1))
        with pipe.exclusive() as version:
            assert version == 1 and engine.weight == 1.0
            calls = len(engine.calls)
            time.sleep(0.1)
            assert len(engine.calls) == calls, "the producer used the engine during exclusive()"


def test_published_weights_are_copied():
    engine = Engine()
    live = weights(1)
    with pipeline(engine, steps=2, max_lag=0) as pipe:
        pipe.take(1, timeout=10)
        pipe.publish(1, live)
        live["w"].fill_(99.0)  # the trainer's next update writes into its own tensors
        assert [w for _, _, w in pipe.take(2, timeout=10).rollouts] == [1.0] * 4


def test_versions_must_increase():
    with pipeline(Engine(), steps=2, max_lag=0) as pipe:
        pipe.publish(1, weights(1))
        with pytest.raises(ValueError, match="version 1 published after version 1"):
            pipe.publish(1, weights(1))


def test_a_generation_error_reaches_the_trainer():
    def run(chunk):
        if chunk == (2, 1):
            raise MemoryError("KV cache exhausted")
        return [chunk]

    with RolloutPipeline(lambda s: [(s, 0), (s, 1)], run, lambda sd: None, first_step=1, last_step=3, max_lag=1) as pipe:
        assert pipe.take(1, timeout=10).rollouts == [(1, 0), (1, 1)]
        with pytest.raises(RuntimeError, match="KV cache exhausted") as info:
            pipe.take(2, timeout=10)
    assert isinstance(info.value.__cause__, MemoryError)


def test_close_stops_a_producer_waiting_for_weights_and_is_idempotent():
    engine = Engine()
    pipe = pipeline(engine, steps=10, max_lag=0)
    pipe.take(1, timeout=10)  # batch 2 now waits for version 1, which never comes
    start = time.perf_counter()
    pipe.close(timeout=10)
    pipe.close(timeout=10)
    assert time.perf_counter() - start < 5
    assert all(step == 1 for step, _, _ in engine.calls)


def test_resume_starts_at_the_checkpoint_step_and_version():
    engine = Engine()
    engine.weight = 4.0  # the engine was synced to the checkpoint's weights (version 4)
    with pipeline(engine, steps=6, max_lag=0, first_step=5) as pipe:
        batches = train(pipe, 6, first_step=5)
    assert [b.versions for b in batches] == [[4] * 4, [5] * 4]


def test_take_times_out_with_a_clear_message():
    with pipeline(Engine(), steps=3, max_lag=0) as pipe:
        pipe.take(1, timeout=10)
        with pytest.raises(TimeoutError, match="batch of step 2 not ready"):
            pipe.take(2, timeout=0.2)
