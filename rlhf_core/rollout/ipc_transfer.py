"""Weight sync to a colocated engine on a GPU: CUDA IPC instead of a process group.

A colocated engine (`policy.rollout.placement: colocated`, the default) runs inside trainer rank
0's worker, vLLM's engine core and its one worker in a child process, on rank 0's GPU. NCCL refuses
a group with two ranks on one GPU ("Duplicate GPU detected"), so the streamed sync of
`weight_transfer.StreamingTransport` cannot reach it. OpenRLHF and verl hand a colocated engine
CUDA IPC handles instead, and NCCL only to engines on other GPUs; `IpcTransport` does the same
through vLLM's "ipc" weight-transfer backend: the protocol, the sources (a state dict, the
trainer's module gathered one parameter at a time under ZeRO-3, a LoRA policy merged as sent) and
the timeout are `StreamingTransport`'s (`weight_transfer.TrainerEngineTransport`).

Packed: the trainer copies the tensors, in the engine's dtype, into one staging buffer of
`packed_buffer_size_bytes` on its GPU, exported once by IPC; per chunk of the buffer the worker
maps it, clones what it holds and loads that. A sync then needs that buffer (vLLM's default,
1 GiB) beside the model, not a second copy of it. vLLM refuses a tensor larger than the buffer,
so the buffer grows to the largest tensor where one is larger (a 7B model's embeddings, 152k x
3,584 in bf16, are 1.09 GB).

The CUDA IPC handles only open in another process than the one that made them: vLLM's default on
a GPU (its engine core, with the worker, in a child process). What crosses into the engine core
is msgpack (vLLM's `MsgpackEncoder`), which refuses the handles as `reduce_tensor` makes them
(classes and a `torch.dtype` among them) unless `VLLM_ALLOW_INSECURE_SERIALIZATION` turns pickle
on for every message. So the handles travel in a wire form of plain values (`handles_to_wire`:
classes and dtypes by name, from a closed list) and the worker rebuilds them before vLLM's own
`update_weights` sees them (`ipc_wire`). Not yet run on a GPU: the CPU tests
drive the trainer's half with the CUDA-only calls (device properties, the buffer's allocation and
export, `ipc_collect`) replaced, and decode the chunks with vLLM's consumer on the host.
"""
from __future__ import annotations

import math

import torch
from vllm.distributed.weight_transfer.base import WeightSource
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine
from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES

from rlhf_core.rollout.ipc_wire import WIRE_METHOD, update_info_to_wire
from rlhf_core.rollout.weight_transfer import LLMClient, TrainerEngineTransport, engine_workers

IPC_BACKEND = "ipc"  # vLLM's own: registered with its weight-transfer factory


class RankZeroIpcTrainer(IPCTrainerWeightTransferEngine):
    """vLLM's IPC trainer engine with one sender: trainer rank 0, which alone shares its GPU with
    the engine.

    vLLM's engine expects every trainer rank to call it (an FSDP trainer whose ranks each hold a
    GPU of the engine's): where torch's default process group has more than one rank, it
    all-gathers every rank's IPC handles over that group and holds a barrier after each chunk and
    each sync. Here the default group is Ray Train's, whose other ranks never call the transport
    (under ZeRO-3 they only join the module's gathers, `deepspeed_engine.follow_gathers`, as for
    the NCCL stream): those collectives would hang rank 0 and them. So this rank's handles are all
    the handles, and after a send only the IPC memory the worker let go of is collected."""

    def _all_gather_and_merge_handles(self, handles: list[dict[str, tuple]]) -> list[dict[str, tuple]]:
        return handles

    @staticmethod
    def _post_send_sync() -> None:
        # No barrier with one sender: vLLM's `_send_packed` resumes its producer, which writes the
        # next chunk into the same buffer, only after `client.update_weights` returned, and
        # `LLMClient.update_weights` is a synchronous collective_rpc: it returns once the worker has
        # cloned the chunk out of the buffer (`packed_ipc_consumer`) and synchronised its device.
        torch.cuda.ipc_collect()


class IpcTransport(TrainerEngineTransport):
    """Hands the weights to a colocated engine's worker by CUDA IPC (vLLM's "ipc" backend, packed,
    through a staging buffer of `packed_buffer_size_bytes` on `device`, trainer rank 0's GPU and
    the engine's), in `dtype` (None: the trainer's). Only rank 0 calls it."""

    def __init__(self, *, dtype: torch.dtype | None = None, device: torch.device | str = "cuda",
                 timeout_s: float = 300.0, packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES):
        super().__init__(IPC_BACKEND, dtype=dtype, device=device, timeout_s=timeout_s)
        self.packed_buffer_size_bytes = packed_buffer_size_bytes

    def _start(self, client: LLMClient, source: WeightSource) -> RankZeroIpcTrainer:
        workers = engine_workers(client.llm)
        if workers != 1:  # each worker would need the handles of its own GPU's memory
            raise ValueError(f"weight sync by CUDA IPC: the colocated engine has {workers} workers, expected 1 on "
                             "the trainer's GPU (engines of several GPUs: policy.rollout.placement: separate)")
        buffer_bytes = max(self.packed_buffer_size_bytes, largest_tensor_bytes(source))  # vLLM refuses a tensor past it
        info = IPCTrainerInitInfo(rank=0, packed=True, packed_buffer_size_bytes=buffer_bytes)
        return RankZeroIpcTrainer.trainer_init(info, client=WireClient(client), source=source)


def largest_tensor_bytes(source: WeightSource) -> int:
    """The bytes of the source's largest tensor in its wire dtype, from its metadata (nothing gathered)."""
    return max((math.prod(m.shape) * m.dtype.itemsize for m in source.metadata()), default=0)



class WireClient:
    """The client vLLM's IPC trainer engine talks to: its updates cross into the engine core in
    wire form (`ipc_wire`), to the worker extension's method that rebuilds them."""

    def __init__(self, client: LLMClient):
        self.client = client

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def update_weights(self, update_info: dict) -> None:
        self.client.call(WIRE_METHOD, update_info_to_wire(update_info))
