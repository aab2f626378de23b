"""Weight sync without files: the trainer streams its tensors into the engine's workers through
vLLM's weight-transfer API.

vLLM's workers speak one protocol for every transport: `init_weight_transfer_engine` once (the
workers join a process group with the trainer), then per sync `start_weight_update`,
`update_weights` (the parameters' names, dtypes and shapes; the tensors follow over the group)
and `finish_weight_update` (the layerwise reload re-runs the model's post-load processing). The
trainer's half is a `TrainerWeightTransferEngine` that drives those calls through a client and
broadcasts the tensors one at a time: no file, and no second copy of the weights in the
engine's dtype. The trainer's side sends either a state dict (`StateDictSource`: a pipelined
run's snapshot) or the trainer's module itself (`ModuleSource`; a LoRA policy's weights merged
as they go, `MergedLoraSource`): each parameter is read where it lives, on the trainer's device,
and under ZeRO-3 gathered while it is sent, every other rank joining that gather
(`deepspeed_engine.follow_gathers`). No rank then holds the whole model, and rank 0's host
holds none of it.

- To engines on GPUs of their own (`engine_group.EngineGroup`) the backend is vLLM's own "nccl"
  (`NCCLTrainerWeightTransferEngine`, the shape of OpenRLHF's `broadcast_to_vllm`): bucketed
  ("packed") broadcasts from the trainer's GPU. A colocated engine shares rank 0's GPU, where
  NCCL refuses a second rank: it takes CUDA IPC handles instead (`ipc_transfer.IpcTransport`,
  the same sources and timeout through `TrainerEngineTransport`, below).
- On CPU the same protocol runs over a gloo group: `GLOO_BACKEND`, registered with vLLM's
  factory when this module is imported (the engine's worker imports it: `EngineWorkerExtension`,
  below, is the class vLLM mixes into its workers). It is how the CPU tests drive the code path that GPUs take;
  the safetensors file (`weight_sync.SafetensorsFileTransport`) stays the CPU default, as fast
  at the sizes a CPU trains.

A sync that does not finish within `timeout_s` raises `WeightSyncTimeout`: the group is then
unusable (the other side may still wait in a collective) and the stage fails, so that a hung
sync ends the run with a message instead of holding its workers forever.
"""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import ParamMeta, TrainerWeightTransferEngine, WeightSource
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    NCCLWeightTransferUpdateInfo,
)

from rlhf_core.models.placement import is_partitioned, module_entries
from rlhf_core.models.lora import is_lora_model, merged_entries, merged_weights
from rlhf_core.rollout.ipc_wire import IpcWireExtension
from rlhf_core.rollout.weight_sync import (
    WeightSyncExtension,
    WeightSyncTimeout,
    WeightTransport,
    gathered,
    on_daemon_thread,
    repack_tied_head,
    within_timeout,
    without_tied_copies,
)

GLOO_BACKEND = "rlhf_gloo"
NCCL_BACKEND = "nccl"
LOOPBACK = "127.0.0.1"  # a colocated engine's workers run on the trainer's node, in rank 0's worker


class EngineWorkerExtension(WeightSyncExtension, IpcWireExtension):
    """What `RolloutEngine` mixes into vLLM's workers (`worker_extension_cls`): the file loader of
    `WeightSyncExtension`, the IPC handles' rebuild of `IpcWireExtension`; and naming this module
    makes each worker import it, which registers `GLOO_BACKEND` in the worker's process, where
    vLLM builds its transfer engine."""


def _group_timeout(timeout_s: float) -> timedelta:
    return timedelta(seconds=max(1.0, timeout_s))


def _gloo_group(host: str, port: int, rank: int, world_size: int, timeout_s: float,
                store: dist.TCPStore | None = None) -> dist.ProcessGroup:
    """A gloo group of `world_size` over the TCP store at host:port (rank 0 owns the store)."""
    if store is None:
        store = dist.TCPStore(host, port, world_size, False, timeout=_group_timeout(timeout_s))
    return dist.ProcessGroupGloo(store, rank, world_size, _group_timeout(timeout_s))


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """The worker's half on CPU: vLLM's NCCL engine with the tensors received over gloo, one
    parameter at a time, into the layerwise reload that `start_weight_update` set up."""

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo) -> None:
        assert init_info.master_address is not None and init_info.master_port is not None
        parallel = self.parallel_config  # the worker's rank across data-parallel replicas, as vLLM's NCCL engine
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.model_update_group = _gloo_group(init_info.master_address, init_info.master_port, rank,
                                              init_info.world_size, timeout_s=300.0)

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        if self.model_update_group is None:
            raise RuntimeError("the gloo weight transfer is not initialised: call init_transfer_engine first")
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.model_update_group.broadcast(weight, 0).wait()
            self.model.load_weights([(name, weight)])

    def finish_weight_update(self) -> None:
        super().finish_weight_update()
        repack_tied_head(self.model)  # vLLM's CPU backend packs the head; a tied one loads nothing

    def shutdown(self) -> None:
        self.model_update_group = None  # a gloo group closes with its last reference


@dataclass
class GlooTrainerInitInfo(NCCLTrainerInitInfo):
    backend: ClassVar[str] = GLOO_BACKEND
    timeout_s: float = 300.0


class GlooTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
    """The trainer's half on CPU: vLLM's NCCL trainer engine (the handshake, the metadata
    checks) with the rendezvous and the broadcast over gloo."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: Any, source: WeightSource | None = None):
        engine = cls(client=client, source=source, is_sender=True, packed=False)
        store = dist.TCPStore(init_info.master_address, init_info.master_port, init_info.world_size, True,
                              timeout=_group_timeout(init_info.timeout_s), wait_for_workers=False)
        worker_info = {"master_address": init_info.master_address, "master_port": store.port, "rank_offset": 1,
                       "world_size": init_info.world_size, "packed": False}
        # the workers block in init until every rank has joined: theirs on a side thread, ours here
        joined = on_daemon_thread(lambda: client.init_weight_transfer_engine(worker_info), "weight-sync-init")
        engine.model_update_group = _gloo_group(init_info.master_address, store.port, 0, init_info.world_size,
                                                init_info.timeout_s, store=store)
        joined.result(timeout=init_info.timeout_s)
        engine._store = store  # the workers' store connections need it alive
        return engine

    def _broadcast(self, source: WeightSource, meta: list[ParamMeta]) -> None:
        assert self.model_update_group is not None
        for _name, tensor in self._checked_iter(source, meta):
            self.model_update_group.broadcast(tensor.contiguous(), 0).wait()

    def _post_send_sync(self) -> None:
        """gloo's broadcast has finished when `wait()` returns: nothing is left in flight."""

    def shutdown(self) -> None:
        self.model_update_group = None


class LLMClient:
    """`VLLMWeightSyncClient` for an `LLM` in this process: each call runs the worker method of
    the same name on every worker (`collective_rpc`), waiting at most `timeout_s`."""

    def __init__(self, llm: Any, timeout_s: float):
        self.llm, self.timeout_s = llm, timeout_s

    def call(self, method: str, *args: Any) -> None:
        self.llm.collective_rpc(method, timeout=self.timeout_s, args=args)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self.call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish_weight_update")

    def shutdown_weight_transfer_engine(self) -> None:
        self.call("shutdown_weight_transfer_engine")


def wire_dtype(dtype: torch.dtype | None, tensor: torch.Tensor, computed: torch.dtype | None = None) -> torch.dtype:
    """What `tensor` crosses in: the transport's `dtype` for floating point (None: the dtype it is
    `computed` in, else its own); integers keep theirs."""
    if not tensor.is_floating_point():
        return tensor.dtype
    return dtype or computed or tensor.dtype


class StateDictSource(WeightSource):
    """The tensors of the latest state dict handed to `set`, in the wire dtype on `device`,
    each shared storage once (a tied head rides with the embeddings). One tensor is converted
    at a time, as the broadcast asks for it: no second copy of the model is made."""

    def __init__(self, dtype: torch.dtype | None, device: torch.device | str = "cpu"):
        self.dtype, self.device = dtype, torch.device(device)
        self.tensors: dict[str, torch.Tensor] = {}

    def set(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.tensors = without_tied_copies(state_dict)

    def _wire_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        return wire_dtype(self.dtype, tensor)

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, self._wire_dtype(t), tuple(t.shape)) for name, t in self.tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.tensors.items():
            yield name, tensor.detach().to(device=self.device, dtype=self._wire_dtype(tensor))


class ModuleSource(WeightSource):
    """The trainer's module as the stream's source: each tensor in the wire dtype on `device`,
    one at a time, a ZeRO-3 parameter gathered (a collective: the other ranks call
    `deepspeed_engine.follow_gathers` meanwhile) only while it is sent, then released."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype | None, device: torch.device | str = "cpu"):
        self.entries = module_entries(module)
        self.dtype, self.device = dtype, torch.device(device)

    def _wire_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        return wire_dtype(self.dtype, tensor)

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, self._wire_dtype(t), tuple(t.ds_shape) if is_partitioned(t) else tuple(t.shape))
                for name, t in self.entries]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return gathered(self.entries, self._copy)  # each sent before its gather ends

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        # a copy: a gathered parameter's memory goes back to DeepSpeed when the gather ends
        return tensor.detach().to(device=self.device, dtype=self._wire_dtype(tensor), copy=True)


class MergedLoraSource(WeightSource):
    """A LoRA policy (a PeftModel) as the stream's source: the plain model's tensors, each adapted
    weight merged with its adapters on the trainer's device as it is sent (`lora.merged_weights`),
    one at a time: no merged copy of the model is built. LoRA runs under ZeRO-1/2, where every
    rank holds the whole module: nothing to gather."""

    def __init__(self, model: Any, dtype: torch.dtype | None, device: torch.device | str = "cpu"):
        self.model, self.dtype, self.device = model, dtype, torch.device(device)

    def _wire_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        return wire_dtype(self.dtype, tensor, computed=torch.float32)  # merged weights are computed in fp32

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, self._wire_dtype(t), tuple(t.shape))
                for name, t, _ in merged_entries(self.model, tied_once=True)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in merged_weights(self.model, tied_once=True):
            yield name, tensor.to(device=self.device, dtype=self._wire_dtype(tensor))


def engine_workers(llm: Any) -> int:
    """The engine's worker processes: tensor x pipeline parallel, times data-parallel replicas
    (an engine group's `engine_workers`: over all its engines)."""
    counted = getattr(llm, "engine_workers", None)
    if isinstance(counted, int):
        return counted
    parallel = llm.llm_engine.vllm_config.parallel_config
    return parallel.world_size * parallel.data_parallel_size


class TrainerEngineTransport(WeightTransport):
    """What the streamed transports share: each sync's source (a state dict, the trainer's module,
    a LoRA policy merged as it goes; in `dtype`, None: the trainer's, read on `device`), replayed by
    one of vLLM's trainer-side engines (`TrainerWeightTransferEngine`, started at the first push by
    `_start`) on a thread bound to the trainer's device, within `timeout_s`. A push that times out
    leaves the transfer in an unknown state: the transport then refuses every later push. The
    engine must be built with `engine_args()`."""

    def __init__(self, backend: str, *, dtype: torch.dtype | None, device: torch.device | str, timeout_s: float):
        self.backend, self.timeout_s = backend, timeout_s
        self.source = StateDictSource(dtype, device)
        self.trainer: TrainerWeightTransferEngine | None = None
        self._broken: str | None = None

    def engine_args(self) -> dict[str, Any]:
        return {"weight_transfer_config": {"backend": self.backend}}

    def push(self, llm: Any, weights: Mapping[str, torch.Tensor] | torch.nn.Module) -> None:
        """`weights`: a state dict, or the trainer's module itself (`ModuleSource`: every other
        rank must call `deepspeed_engine.follow_gathers` on its module meanwhile)."""
        if self._broken:
            raise WeightSyncTimeout(self._broken)
        source = self._source_of(weights)
        within_timeout(lambda: self._send(llm, source), self.timeout_s, self._give_up)

    def _source_of(self, weights: Mapping[str, torch.Tensor] | torch.nn.Module) -> WeightSource:
        if is_lora_model(weights):
            return MergedLoraSource(weights, self.source.dtype, self.source.device)
        if isinstance(weights, torch.nn.Module):
            return ModuleSource(weights, self.source.dtype, self.source.device)
        self.source.set(weights)
        return self.source

    def _send(self, llm: Any, source: WeightSource) -> None:
        if self.source.device.type == "cuda":  # the trainer's, on this thread: NCCL binds it, IPC allocates on it
            torch.cuda.set_device(self.source.device)
        if self.trainer is None:
            self.trainer = self._start(LLMClient(llm, self.timeout_s), source)
        self.trainer.source = source  # this sync's: the state dict's or the module's
        self.trainer.send_weights()

    @abstractmethod
    def _start(self, client: LLMClient, source: WeightSource) -> TrainerWeightTransferEngine:
        """The trainer's engine, its handshake with the engine's workers done."""

    def _give_up(self) -> str:
        self._broken = (f"weight sync ({self.backend}) did not finish within {self.timeout_s:g} s "
                        "(policy.rollout.sync_timeout_s); the engine's workers may still wait in the transfer, "
                        "so the engine takes no more weights: restart the stage (rlhf run --resume)")
        return self._broken

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.shutdown()
            self.trainer = None


class StreamingTransport(TrainerEngineTransport):
    """Streams the state dict into the workers over a process group (`GLOO_BACKEND` on CPU,
    vLLM's `NCCL_BACKEND` on GPUs) in `dtype` (None: the trainer's). The group is set up at the
    first push, the trainer listening on `master_address` (loopback for a colocated engine; the
    trainer's node address when the engines are Ray actors that may run elsewhere,
    `engine_group.EngineGroup`)."""

    def __init__(self, backend: str = GLOO_BACKEND, *, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu", timeout_s: float = 300.0, master_address: str = LOOPBACK):
        if backend not in (GLOO_BACKEND, NCCL_BACKEND):
            raise ValueError(f"weight transport backend {backend!r}: expected {GLOO_BACKEND!r} or {NCCL_BACKEND!r}")
        super().__init__(backend, dtype=dtype, device=device, timeout_s=timeout_s)
        self.master_address = master_address

    def _start(self, client: LLMClient, source: WeightSource) -> TrainerWeightTransferEngine:
        world_size = 1 + engine_workers(client.llm)
        if self.backend == GLOO_BACKEND:
            info = GlooTrainerInitInfo(rank=0, master_address=self.master_address, master_port=0, world_size=world_size,
                                       timeout_s=self.timeout_s)
            return GlooTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
        from vllm.utils.network_utils import get_open_port

        info = NCCLTrainerInitInfo(rank=0, master_address=self.master_address, master_port=get_open_port(),
                                   world_size=world_size)
        return NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)


if GLOO_BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(GLOO_BACKEND, GlooWeightTransferEngine)
