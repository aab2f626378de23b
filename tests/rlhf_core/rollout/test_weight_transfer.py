"""The weight transports' and the engine's sleep logic, without a running engine: what the
streamed source yields, which transport a run gets, that a hung sync raises within its timeout,
and in which order a sleeping engine is woken. The transports against a
running vLLM engine (gloo and the file, tied and untied heads): tests/rlhf_core/models/test_families.py."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from rlhf_core.config import RolloutEngineConfig
from rlhf_core.rollout.factory import weight_transport
from rlhf_core.rollout.weight_sync import SafetensorsFileTransport, WeightSyncTimeout, within_timeout
from rlhf_core.rollout.weight_transfer import (
    GLOO_BACKEND,
    NCCL_BACKEND,
    LLMClient,
    StateDictSource,
    StreamingTransport,
    TrainerEngineTransport,
)


def tied_state_dict() -> dict[str, torch.Tensor]:
    embed = torch.randn(10, 4)
    return {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(4),
            "lm_head.weight": embed, "model.layers.0.step": torch.tensor([3])}  # the head is the embeddings


def test_the_source_yields_each_tensor_once_in_the_wire_dtype_as_its_metadata_says():
    source = StateDictSource(torch.bfloat16)
    source.set(tied_state_dict())
    meta = source.metadata()
    pairs = list(source)
    assert [m.name for m in meta] == [name for name, _ in pairs] == [
        "model.embed_tokens.weight", "model.norm.weight", "model.layers.0.step"]  # the tied head rides along
    assert [(m.dtype, m.shape) for m in meta] == [(t.dtype, tuple(t.shape)) for _, t in pairs] == [
        (torch.bfloat16, (10, 4)), (torch.bfloat16, (4,)), (torch.int64, (1,))]  # integers keep theirs
    latest = tied_state_dict()
    source.set(latest)  # each sync hands the latest weights
    assert torch.equal(next(iter(source))[1], latest["model.embed_tokens.weight"].bfloat16())


def test_the_source_keeps_the_trainers_dtype_when_none_is_asked():
    source = StateDictSource(None)
    source.set({"w": torch.zeros(2, dtype=torch.float32)})
    assert [m.dtype for m in source.metadata()] == [torch.float32]


class RecordingLLM:
    """Stands in for `vllm.LLM`'s control plane only: records each collective_rpc, or blocks."""

    def __init__(self, block: threading.Event | None = None):
        self.calls: list[tuple[str, float | None, tuple]] = []
        self.block = block

    def collective_rpc(self, method, timeout=None, args=()):
        self.calls.append((method, timeout, args))
        if self.block is not None:
            self.block.wait()
        return [len(args[0]) if args and isinstance(args[0], dict) else 0]


def test_the_client_calls_the_workers_methods_of_vllms_protocol_with_its_timeout():
    llm = RecordingLLM()
    client = LLMClient(llm, timeout_s=7.0)
    client.init_weight_transfer_engine({"master_port": 1})
    client.start_weight_update()
    client.update_weights({"names": []})
    client.finish_weight_update("v2")
    assert [(m, t) for m, t, _ in llm.calls] == [("init_weight_transfer_engine", 7.0), ("start_weight_update", 7.0),
                                                 ("update_weights", 7.0), ("finish_weight_update", 7.0)]
    assert llm.calls[0][2] == ({"master_port": 1},)


def test_within_timeout_returns_or_raises_what_the_work_raised():
    within_timeout(lambda: None, 5.0, lambda: "unused")
    with pytest.raises(ZeroDivisionError):
        within_timeout(lambda: 1 / 0, 5.0, lambda: "unused")


@pytest.fixture
def hung_llm_engine():
    """A stand-in whose workers never answer, until the test ends: then they are let go, so
    that no thread of the test is left waiting."""
    events = []

    def make(workers: int = 1) -> RecordingLLM:
        events.append(threading.Event())
        llm = RecordingLLM(block=events[-1])
        parallel = type("Parallel", (), {"world_size": workers, "data_parallel_size": 1})
        llm.llm_engine = type("Engine", (), {"vllm_config": type("Config", (), {"parallel_config": parallel})})
        return llm
    yield make
    for event in events:
        event.set()


@pytest.mark.parametrize("transport", [
    lambda: StreamingTransport(GLOO_BACKEND, timeout_s=0.5),
    lambda: SafetensorsFileTransport(timeout_s=0.5),
], ids=["stream", "file"])
def test_a_sync_that_hangs_raises_within_its_timeout_and_says_which_setting(transport, hung_llm_engine):
    transport = transport()
    try:
        start = time.monotonic()
        with pytest.raises(WeightSyncTimeout, match=r"within 0.5 s \(policy.rollout.sync_timeout_s\)"):
            transport.push(hung_llm_engine(), {"w": torch.zeros(3)})
        assert time.monotonic() - start < 5.0
    finally:
        transport.close()


def test_a_stream_that_timed_out_takes_no_more_weights(hung_llm_engine):
    transport = StreamingTransport(GLOO_BACKEND, timeout_s=0.3)
    with pytest.raises(WeightSyncTimeout):
        transport.push(hung_llm_engine(), {"w": torch.zeros(3)})
    start = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match="takes no more weights"):
        transport.push(hung_llm_engine(), {"w": torch.zeros(3)})
    assert time.monotonic() - start < 0.2  # refused at once, not after another wait


def test_the_engine_is_built_for_the_streamed_backend():
    assert StreamingTransport(NCCL_BACKEND).engine_args() == {"weight_transfer_config": {"backend": "nccl"}}
    assert StreamingTransport().engine_args() == {"weight_transfer_config": {"backend": GLOO_BACKEND}}
    assert SafetensorsFileTransport(timeout_s=1).engine_args() == {}
    with pytest.raises(ValueError, match="'ipc'"):
        StreamingTransport("ipc")


@pytest.mark.parametrize("weight_sync, device, expected", [
    ("auto", "cpu", ("file", None)),
    ("auto", "cuda", ("ipc", torch.bfloat16)),  # a colocated engine: tests/rlhf_core/rollout/test_ipc_transfer.py
    ("stream", "cpu", (GLOO_BACKEND, torch.bfloat16)),
    ("file", "cuda", ("file", None)),
])
def test_the_run_gets_the_transport_its_config_and_device_ask_for(weight_sync, device, expected):
    rollout = RolloutEngineConfig(weight_sync=weight_sync, sync_timeout_s=42)
    transport = weight_transport(rollout, "bfloat16", torch.device(device))
    try:
        got = ("file", None) if isinstance(transport, SafetensorsFileTransport) else (
            transport.backend, transport.source.dtype)
        assert got == expected
        assert transport.timeout_s == 42
        if isinstance(transport, TrainerEngineTransport):
            assert transport.source.device == torch.device(device)  # tensors go out from the trainer's device
    finally:
        transport.close()


class FakeLLM:
    """Records what `RolloutEngine` asks of `vllm.LLM` (sleep mode needs CUDA, so on this machine
    its calls can only be checked for their order)."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []

    def get_tokenizer(self):
        return type("Tokenizer", (), {"batch_decode": staticmethod(lambda ids, **_: [])})

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append(("generate",))
        return []


class PushRecorder(SafetensorsFileTransport):
    def push(self, llm, state_dict):
        llm.calls.append(("push", sorted(state_dict)))


@pytest.fixture
def fake_gpu_engine(monkeypatch, tmp_path):
    import rlhf_core.rollout.vllm_engine as vllm_engine

    monkeypatch.setattr(vllm_engine, "LLM", FakeLLM)
    monkeypatch.setattr(vllm_engine, "current_platform", type("Cuda", (), {"is_cpu": staticmethod(lambda: False)}))

    def make(sleep_mode: bool):
        return vllm_engine.RolloutEngine(tmp_path, sleep_mode=sleep_mode, transport=PushRecorder(timeout_s=5))
    return make


def test_a_sleeping_engine_frees_its_memory_after_generating_and_wakes_weights_first_at_the_sync(fake_gpu_engine):
    engine = fake_gpu_engine(sleep_mode=True)
    assert engine.llm.kwargs["enable_sleep_mode"] is True
    engine.generate(["1+1="])
    engine.release()
    engine.release()  # already asleep: nothing more
    with pytest.raises(RuntimeError, match="sleeps .* until the next sync_weights"):
        engine.generate(["1+1="])  # its weights were discarded: nothing to sample from
    engine.sync_weights({"w": torch.zeros(1)})
    engine.generate(["1+1="])
    assert engine.llm.calls == [("generate",), ("sleep", 2), ("wake_up", ("weights",)), ("push", ["w"]),
                                ("wake_up", ("kv_cache",)), ("reset_prefix_cache",), ("generate",)]
    assert "rollout/sleep_s" in engine.last_metrics


def test_without_sleep_mode_release_does_nothing(fake_gpu_engine):
    engine = fake_gpu_engine(sleep_mode=False)
    assert "enable_sleep_mode" not in engine.llm.kwargs
    engine.release()
    engine.sync_weights({"w": torch.zeros(1)})
    assert engine.llm.calls == [("push", ["w"]), ("reset_prefix_cache",)]


def test_sleep_mode_on_cpu_is_refused_naming_the_setting(tmp_path):
    from rlhf_core.rollout.vllm_engine import RolloutEngine

    with pytest.raises(ValueError, match="policy.rollout.sleep: vLLM's CPU backend has no sleep mode"):
        RolloutEngine(tmp_path, sleep_mode=True)


@pytest.mark.parametrize("sleep, max_lag, device, expected", [
    (None, 0, "cuda", True), (None, 1, "cuda", False), (None, 0, "cpu", False), (False, 0, "cuda", False),
    (True, 0, "cuda", True),
])
def test_the_engine_sleeps_on_gpu_unless_pipelined_or_told_not_to(sleep, max_lag, device, expected):
    from rlhf_core.rollout.factory import engine_sleeps

    assert engine_sleeps(RolloutEngineConfig(sleep=sleep), max_lag > 0, device) is expected


def test_a_pipelined_engine_that_should_sleep_is_refused_by_the_config():
    from pydantic import ValidationError

    from rlhf_core.config import PolicyConfig

    with pytest.raises(ValidationError, match="a pipelined engine generates the next batch during the update"):
        PolicyConfig.model_validate({"rollout": {"sleep": True}, "pipeline": {"max_lag": 1}})


def test_a_lora_policy_streams_its_merged_weights_as_announced_one_at_a_time(tmp_path):
    """`MergedLoraSource`: the metadata the engine sizes its buffers from is what iteration sends
    (names, wire dtype, shapes), each weight the merged state dict's in the wire dtype."""
    from rlhf_core.config import LoRAConfig, ModelConfig
    from rlhf_core.models.llama import build_policy, save_pretrained_atomic
    from rlhf_core.models.lora import load_policy_for_training, merged_state_dict
    from rlhf_core.rollout.weight_transfer import MergedLoraSource
    from rlhf_core.tokenizer import train_tokenizer

    tok = train_tokenizer([f"{a:02d}+{b:02d}={a + b:03d}" for a in range(20) for b in range(20)], vocab_size=64)
    tiny = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2)
    path = save_pretrained_atomic(build_policy(tiny, tok, seed=0), tok, tmp_path / "base")
    model = load_policy_for_training(path, LoRAConfig(enabled=True, rank=4))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    source = MergedLoraSource(model, torch.bfloat16)
    sent = list(source)
    assert [(m.name, m.dtype, tuple(m.shape)) for m in source.metadata()] == [
        (name, t.dtype, tuple(t.shape)) for name, t in sent]
    merged = merged_state_dict(model)
    assert {name for name, _ in sent} <= set(merged) and all(".lora_" not in name for name, _ in sent)
    for name, tensor in sent:
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, merged[name].to(torch.bfloat16)), name
