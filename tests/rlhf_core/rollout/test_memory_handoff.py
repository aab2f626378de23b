"""The memory hand-off of a colocated engine: before a sleeping engine wakes, the trainer's
process hands its cached, unused GPU blocks back (`torch.cuda.empty_cache`), so the engine can
map them again: the preflight's sleep discount counts on it. Checked with the engine's real
`sync_weights` around a recording stand-in for vLLM's `LLM`; CUDA is simulated."""
from __future__ import annotations

import pytest
import torch

from rlhf_core.rollout import factory
from rlhf_core.rollout.vllm_engine import RolloutEngine


class RecordingLLM:
    def __init__(self, calls):
        self.calls = calls

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


class RecordingTransport:
    def __init__(self, calls):
        self.calls = calls

    def push(self, llm, state_dict):
        self.calls.append(("push",))


@pytest.fixture
def engine(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    engine = object.__new__(RolloutEngine)  # the engine's state without starting vLLM
    engine.llm, engine.transport, engine.last_metrics = RecordingLLM(calls), RecordingTransport(calls), {}
    return engine, calls


def test_a_sleeping_engine_wakes_after_the_trainer_emptied_its_cache(engine):
    engine, calls = engine
    engine.asleep = True
    engine.sync_weights({})
    assert calls == [("empty_cache",), ("wake_up", ("weights",)), ("push",), ("wake_up", ("kv_cache",)),
                     ("reset_prefix_cache",)]
    assert not engine.asleep


def test_an_awake_engine_takes_weights_without_touching_the_cache(engine):
    engine, calls = engine
    engine.asleep = False
    engine.sync_weights({})
    assert calls == [("push",), ("reset_prefix_cache",)]


def test_off_cuda_there_is_nothing_to_release(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: pytest.fail("no CUDA: nothing to empty"))
    factory.release_cached_memory()
