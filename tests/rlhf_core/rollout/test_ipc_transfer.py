"""The CUDA IPC weight sync of a colocated engine, without a GPU: which transport a run gets, and
the trainer's half end to end on the host.

This machine has no CUDA, so the CUDA-only calls are replaced where vLLM makes them: the GPU's
UUID, the staging buffer's allocation on "cuda" and its IPC export (`reduce_tensor`), the stream
drained before a chunk is handed over, and `torch.cuda.ipc_collect`. Everything else is vLLM's and
ours: the packed producer, the trainer engine's calls, the update payload's validation and the
consumer's decode (`packed_ipc_consumer`), which reads the chunks back out of the host buffer.
Every call crosses into the engine core as it does on a GPU, where the core is a process of its
own: encoded and decoded by vLLM's msgpack codec, with insecure serialization off.
vLLM's worker side (`IPCWeightTransferEngine.receive_weights`, which maps the handle on its GPU and
loads into a vLLM model) is not run here."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.weight_transfer import packed_tensor
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.packed_tensor import packed_ipc_consumer
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from rlhf_core.config import RolloutEngineConfig
from rlhf_core.models.placement import module_entries
from rlhf_core.rollout.factory import weight_transport
from rlhf_core.rollout.ipc_transfer import IpcTransport, largest_tensor_bytes
from rlhf_core.rollout.ipc_wire import WIRE_METHOD, IpcWireExtension, handles_from_wire, handles_to_wire
from rlhf_core.rollout.weight_sync import SafetensorsFileTransport, WeightSyncTimeout
from rlhf_core.rollout.weight_transfer import (
    GLOO_BACKEND,
    NCCL_BACKEND,
    StateDictSource,
    StreamingTransport,
)

GPU = "GPU-host-stand-in"
BUFFER_BYTES = 260  # one or two tensors of the tiny model per chunk: a sync takes several chunks


# ----------------------------------------------------------------------------- which transport


@pytest.mark.parametrize("weight_sync", ["auto", "stream"])
def test_a_colocated_engine_on_a_gpu_takes_the_weights_by_cuda_ipc(weight_sync):
    rollout = RolloutEngineConfig(weight_sync=weight_sync, sync_timeout_s=42)
    transport = weight_transport(rollout, "bfloat16", torch.device("cuda", 0))
    assert isinstance(transport, IpcTransport)
    assert transport.engine_args() == {"weight_transfer_config": {"backend": "ipc"}}
    assert (transport.source.dtype, transport.source.device, transport.timeout_s) == (
        torch.bfloat16, torch.device("cuda", 0), 42)


def test_engines_of_their_own_on_gpus_take_them_over_nccl_from_the_trainers_address():
    rollout = RolloutEngineConfig(placement="separate", sync_timeout_s=42)
    transport = weight_transport(rollout, "bfloat16", torch.device("cuda", 0), master_address="10.0.0.7")
    assert isinstance(transport, StreamingTransport) and transport.backend == NCCL_BACKEND
    assert transport.engine_args() == {"weight_transfer_config": {"backend": "nccl"}}
    assert (transport.master_address, transport.source.dtype) == ("10.0.0.7", torch.bfloat16)


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_on_cpu_the_choice_is_as_before_a_file_or_gloo_when_asked(placement):
    file = weight_transport(RolloutEngineConfig(placement=placement), "float32", torch.device("cpu"))
    stream = weight_transport(RolloutEngineConfig(placement=placement, weight_sync="stream"), "float32",
                              torch.device("cpu"))
    try:
        assert isinstance(file, SafetensorsFileTransport)
        assert isinstance(stream, StreamingTransport) and stream.backend == GLOO_BACKEND
    finally:
        file.close()


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_a_file_asked_for_on_a_gpu_stays_a_file(placement):
    transport = weight_transport(RolloutEngineConfig(placement=placement, weight_sync="file"), "bfloat16",
                                 torch.device("cuda", 0))
    try:
        assert isinstance(transport, SafetensorsFileTransport)
    finally:
        transport.close()


# ----------------------------------------------------------------------------- the send path on the host


class HostTorch:
    """`torch` as vLLM's packed_tensor module sees it: the staging buffer it allocates on "cuda" is
    made on the host, which has no streams to drain, and the GPU's UUID is a constant."""

    cuda = SimpleNamespace(current_stream=lambda: SimpleNamespace(synchronize=lambda: None),
                           get_device_properties=lambda index: SimpleNamespace(uuid=GPU))

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*shape, device=None, **kwargs):
        return torch.empty(*shape, **kwargs)


@pytest.fixture
def host_ipc(monkeypatch):
    """The CUDA-only calls of vLLM's IPC path replaced (see the module docstring). `exported`:
    the buffers `reduce_tensor` exported, by the key their handle carries; `collected`: how often
    `torch.cuda.ipc_collect` ran."""
    state = SimpleNamespace(exported={}, collected=0)

    def reduce_tensor(tensor):
        key = len(state.exported)
        state.exported[key] = tensor
        # rebuild_cuda_tensor's arguments as torch makes them for a CUDA tensor: [6] the device index,
        # [7] the allocation's handle (here the exported buffer's key)
        return None, (type(tensor), tensor.size(), tensor.stride(), 0, torch.UntypedStorage, tensor.dtype, 0,
                      f"host-{key}".encode(), tensor.untyped_storage().nbytes(), 0, False, b"ref", 0, b"event", True)

    def ipc_collect():
        state.collected += 1

    monkeypatch.setattr(packed_tensor, "torch", HostTorch())
    monkeypatch.setattr(packed_tensor, "reduce_tensor", reduce_tensor)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid=GPU))
    monkeypatch.setattr(torch.cuda, "ipc_collect", ipc_collect)
    return state


class HostImporter:
    """The worker's mapping of the exported buffer (`PackedBufferImporter.rebuild`), on the host."""

    def __init__(self, exported: dict[int, torch.Tensor]):
        self.exported = exported

    def rebuild(self, args: list) -> torch.Tensor:
        assert args[0] is torch.Tensor and args[4] is torch.UntypedStorage and isinstance(args[5], torch.dtype)
        return self.exported[int(args[7].decode().removeprefix("host-"))]


class HostWorker(IpcWireExtension):
    """vLLM's worker with the engine's extension mixed in: `update_weights` is vLLM's payload check
    and its packed consumer, decoding each chunk out of the host buffer."""

    def __init__(self, importer: HostImporter):
        self.importer, self.received = importer, {}

    def update_weights(self, update_info: dict) -> None:
        info = IPCWeightTransferUpdateInfo(**update_info)
        self.received.update(packed_ipc_consumer(
            ipc_handle=info.ipc_handles, names=info.names, shapes=info.shapes, dtype_names=info.dtype_names,
            tensor_sizes=info.tensor_sizes, device_index=0, importer=self.importer))


class DecodingLLM:
    """Stands in for `vllm.LLM`'s control plane: records each collective_rpc, sends its arguments
    through vLLM's msgpack codec as they cross into the engine core, and runs the worker's method
    on what came out (`HostWorker`: every chunk decoded before returning); a `hang_on` method
    never answers until `release` is set."""

    def __init__(self, exported: dict[int, torch.Tensor], hang_on: str | None = None, workers: int = 1):
        self.calls: list[tuple[str, tuple]] = []
        self.worker = HostWorker(HostImporter(exported))
        self.received = self.worker.received
        self.encoder, self.decoder = MsgpackEncoder(), MsgpackDecoder()
        self.hang_on, self.release = hang_on, threading.Event()
        parallel = SimpleNamespace(world_size=workers, data_parallel_size=1)
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel))

    def collective_rpc(self, method, timeout=None, args=()):
        self.calls.append((method, args))
        if method == self.hang_on:
            self.release.wait()
        crossed = self.decoder.decode(self.encoder.encode(args))  # raises on what msgpack cannot carry
        if method in ("update_weights", WIRE_METHOD):
            getattr(self.worker, method)(*crossed)
        return [None]


class TinyTied(torch.nn.Module):
    """Tied embeddings and head, two layers and an integer buffer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.lm_head = torch.nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("steps", torch.tensor([3]))


def expected_on_the_wire(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the engine should load: each tensor once (the tied head rides with the embeddings, as
    for `StreamingTransport`), floating point in bf16, integers as they are."""
    return {name: t.detach().to(torch.bfloat16) if t.is_floating_point() else t.detach()
            for name, t in module_entries(module)}


@pytest.fixture
def no_collectives(monkeypatch):
    """A default process group of two ranks, as under Ray Train, whose collectives must not run:
    the other ranks never call the transport."""
    def refuse(*args, **kwargs):
        raise AssertionError("a torch.distributed collective over the trainer's default group")

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    for name in ("all_gather_object", "barrier", "all_gather", "broadcast", "all_reduce"):
        monkeypatch.setattr(torch.distributed, name, refuse)


@pytest.mark.parametrize("as_module", [True, False], ids=["module", "state_dict"])
def test_rank_0_hands_every_tensor_over_in_chunks_of_one_reused_buffer(host_ipc, no_collectives, as_module):
    model = TinyTied()
    transport = IpcTransport(dtype=torch.bfloat16, device="cpu", timeout_s=30, packed_buffer_size_bytes=BUFFER_BYTES)
    llm = DecodingLLM(host_ipc.exported)
    for _ in range(2):
        transport.push(llm, model if as_module else model.state_dict())
    methods = [m for m, _ in llm.calls]
    one_sync = ["start_weight_update", *[WIRE_METHOD] * (methods.count(WIRE_METHOD) // 2), "finish_weight_update"]
    assert methods == ["init_weight_transfer_engine", *one_sync, *one_sync]
    assert llm.calls[0][1] == ({"packed": True},)
    assert methods.count(WIRE_METHOD) // 2 >= 3  # several chunks a sync: the buffer is reused, not grown
    assert list(llm.received) == list(expected_on_the_wire(model))  # the tied head once, in metadata order
    for name, tensor in expected_on_the_wire(model).items():
        assert llm.received[name].dtype == tensor.dtype and torch.equal(llm.received[name], tensor), name
    assert [b.numel() for b in host_ipc.exported.values()] == [BUFFER_BYTES, BUFFER_BYTES]  # one export a sync
    assert host_ipc.collected >= 2  # after every chunk and every sync: no barrier, only ipc_collect


def test_the_buffer_grows_to_the_largest_tensor():
    source = StateDictSource(torch.bfloat16)
    source.set({"embed": torch.zeros(100, 8), "norm": torch.zeros(8)})
    assert largest_tensor_bytes(source) == 100 * 8 * 2


def test_a_larger_tensor_than_the_buffer_still_goes_across(host_ipc):
    transport = IpcTransport(dtype=torch.bfloat16, device="cpu", timeout_s=30, packed_buffer_size_bytes=64)
    llm = DecodingLLM(host_ipc.exported)
    transport.push(llm, {"embed": torch.ones(100, 8), "norm": torch.ones(8)})
    assert torch.equal(llm.received["embed"], torch.ones(100, 8, dtype=torch.bfloat16))
    assert host_ipc.exported[0].numel() == 1600


def test_an_engine_of_several_workers_is_refused_naming_the_setting(host_ipc):
    transport = IpcTransport(device="cpu", timeout_s=30)
    with pytest.raises(ValueError, match="policy.rollout.placement: separate"):
        transport.push(DecodingLLM(host_ipc.exported, workers=2), {"w": torch.zeros(2)})


@pytest.fixture
def hung_llm(host_ipc):
    made: list[DecodingLLM] = []

    def make(method: str) -> DecodingLLM:
        made.append(DecodingLLM(host_ipc.exported, hang_on=method))
        return made[-1]
    yield make
    for llm in made:
        llm.release.set()  # no thread of the test left waiting


def test_a_sync_that_hangs_raises_within_its_timeout_and_takes_no_more_weights(hung_llm):
    transport = IpcTransport(device="cpu", timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match=r"\(ipc\) did not finish within 0.5 s \(policy.rollout.sync_timeout_s"):
        transport.push(hung_llm(WIRE_METHOD), {"w": torch.zeros(3)})
    assert time.monotonic() - start < 5.0
    start = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match="takes no more weights"):
        transport.push(hung_llm(WIRE_METHOD), {"w": torch.zeros(3)})
    assert time.monotonic() - start < 0.2  # refused at once, not after another wait


# ----------------------------------------------------------------------------- the engine-core boundary


def cuda_handle() -> tuple:
    """`reduce_tensor`'s arguments for a CUDA tensor, as torch 2.13 makes them."""
    return (torch.nn.Parameter, torch.Size([4, 2]), (2, 1), 0, torch.UntypedStorage, torch.bfloat16, 0,
            b"\x01cuda-ipc-handle", 16, 0, False, b"refcount", 0, b"event", True)


def test_vllms_codec_refuses_the_raw_handles_and_carries_their_wire_form(monkeypatch):
    """On a GPU the engine core is another process and takes its calls as msgpack: the handles as
    `reduce_tensor` makes them were refused ("Object of type torch._C._TensorMeta is not
    serializable"), failing every colocated sync at its first chunk. Their wire form crosses and
    comes back the same, classes and dtype included, with insecure serialization off."""
    import vllm.envs

    monkeypatch.setattr(vllm.envs, "VLLM_ALLOW_INSECURE_SERIALIZATION", False, raising=False)
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder()
    raw = {GPU: cuda_handle()}
    with pytest.raises(TypeError, match="is not serializable"):
        encoder.encode(({"ipc_handles": raw},))
    [crossed] = decoder.decode(encoder.encode(({"ipc_handles": handles_to_wire(raw)},)))
    assert handles_from_wire(crossed["ipc_handles"]) == raw
    unpacked = [raw, {GPU: cuda_handle()[:5] + (torch.float32,) + cuda_handle()[6:]}]  # one dict a tensor
    assert handles_from_wire(decoder.decode(encoder.encode(handles_to_wire(unpacked)))) == unpacked


def test_a_handle_naming_any_other_class_is_refused_not_imported():
    wire = handles_to_wire({GPU: cuda_handle()})
    wire[GPU][0] = "os.system"
    with pytest.raises(ValueError, match="names the class 'os.system', which is not one a CUDA tensor's handle holds"):
        handles_from_wire(wire)
    wire[GPU][0], wire[GPU][5] = "torch.Tensor", "Tensor"
    with pytest.raises(ValueError, match="'Tensor' is not a torch dtype"):
        handles_from_wire(wire)


@pytest.mark.slow  # a vLLM engine whose engine core and worker are processes of their own: about 30 s
def test_a_sync_crosses_into_an_engine_core_of_its_own_process_and_reaches_vllms_receiver(
        host_ipc, monkeypatch, tmp_path):
    """As on a GPU, the engine core runs in a process of its own (here with its worker in a third):
    every call crosses as msgpack. The raw handles are refused by vLLM's client before they leave;
    the transport's sync crosses, the worker rebuilds the handles of the packed buffer to exactly what
    `rebuild_cuda_tensor` takes, and vLLM's own receiver runs on them until it opens the CUDA handle,
    which only a GPU can."""
    from vllm import LLM

    from rlhf_core.models.llama import load_policy
    from rlhf_core.testing.models import tiny_policy_dir

    here = str(Path(__file__).parent)  # where vLLM's worker process finds the extension
    monkeypatch.syspath_prepend(here)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    policy = tiny_policy_dir(tmp_path / "policy")
    transport = IpcTransport(dtype=torch.bfloat16, device="cpu", timeout_s=120, packed_buffer_size_bytes=1 << 20)
    llm = LLM(model=str(policy), dtype="float32", enforce_eager=True, max_model_len=32, max_num_seqs=4,
              worker_extension_cls="engine_core_probe.RecordingExtension", kv_cache_memory_bytes=1 << 24,
              **transport.engine_args())
    try:
        handles = {GPU: cuda_handle()}
        with pytest.raises(TypeError, match="is not serializable"):
            llm.collective_rpc("update_weights", args=({"ipc_handles": handles},))
        model = load_policy(policy)
        with pytest.raises(Exception, match="failed"):  # vLLM's receiver stopped at the CUDA handle
            transport.push(llm, model)
        [received] = llm.collective_rpc("rlhf_received")
    finally:
        llm.llm_engine.engine_core.shutdown()
    [chunk, ended] = received
    assert {k: chunk[k] for k in ("gpu", "tensor", "size", "storage", "dtype", "handle")} == {
        "gpu": GPU, "tensor": "Tensor", "size": "Size", "storage": "UntypedStorage", "dtype": "torch.uint8",
        "handle": "bytes"}  # the packed buffer's handle, rebuilt in the worker's process
    assert chunk["names"] == list(expected_on_the_wire(model))  # every tensor in one chunk of 1 MiB
    assert ended == {"raised": "AssertionError: Torch not compiled with CUDA enabled"}
