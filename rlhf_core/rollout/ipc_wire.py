"""CUDA IPC handles in a form msgpack carries, for the weight sync to a colocated engine.

`torch.multiprocessing.reductions.reduce_tensor` describes a CUDA tensor by the arguments of
`rebuild_cuda_tensor`: two classes, a `torch.Size`, a `torch.dtype`, the allocation's handle
(bytes) and plain numbers. vLLM's engine core, a process of its own on a GPU, takes its calls
as msgpack (`vllm.v1.serial_utils.MsgpackEncoder`), which refuses classes and dtypes unless
`VLLM_ALLOW_INSECURE_SERIALIZATION` turns pickle on for every message. So the trainer sends the
handles with classes and dtypes by name (`handles_to_wire`), and the worker, where the handles
are opened, rebuilds them from a closed list of names (`handles_from_wire`) before vLLM's own
`update_weights` sees them (`IpcWireExtension`, mixed into every worker).
"""
from __future__ import annotations

import torch

WIRE_METHOD = "rlhf_update_weights_from_wire"  # the worker extension's method the client calls instead
# The classes `reduce_tensor` names in a CUDA tensor's handle, by the names the wire carries: nothing
# else is rebuilt (a name off this list is refused, not imported)
_WIRE_CLASSES = {f"{c.__module__}.{c.__qualname__}": c for c in (
    torch.Tensor, torch.nn.Parameter, torch.UntypedStorage, torch.storage.TypedStorage)}
_CLASS_FIELDS, _DTYPE_FIELD = (0, 4), 5  # positions in rebuild_cuda_tensor's arguments


def _wire_value(i: int, value):
    if i in _CLASS_FIELDS:
        return f"{value.__module__}.{value.__qualname__}"
    if i == _DTYPE_FIELD:
        return str(value).removeprefix("torch.")
    return list(value) if isinstance(value, tuple) else value  # torch.Size, strides


def _rebuilt_value(i: int, value):
    if i in _CLASS_FIELDS:
        if value not in _WIRE_CLASSES:
            raise ValueError(f"weight sync by CUDA IPC: a handle names the class {value!r}, which is not one a "
                             f"CUDA tensor's handle holds ({', '.join(sorted(_WIRE_CLASSES))})")
        return _WIRE_CLASSES[value]
    if i == _DTYPE_FIELD:
        dtype = getattr(torch, value, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"weight sync by CUDA IPC: {value!r} is not a torch dtype")
        return dtype
    return torch.Size(value) if i == 1 else tuple(value) if i == 2 else value


def handles_to_wire(ipc_handles):
    """`ipc_handles` (GPU UUID -> `reduce_tensor` arguments; a list of such dicts unpacked) with
    every value msgpack can carry: classes by qualified name, the dtype by its name."""
    if isinstance(ipc_handles, list):
        return [handles_to_wire(h) for h in ipc_handles]
    return {uuid: [_wire_value(i, v) for i, v in enumerate(args)] for uuid, args in ipc_handles.items()}


def handles_from_wire(wire):
    """The `ipc_handles` that `handles_to_wire` was given."""
    if isinstance(wire, list):
        return [handles_from_wire(h) for h in wire]
    return {uuid: tuple(_rebuilt_value(i, v) for i, v in enumerate(args)) for uuid, args in wire.items()}


def update_info_to_wire(update_info: dict) -> dict:
    """An IPC update as the engine core can carry it: its handles in wire form."""
    return {**update_info, "ipc_handles": handles_to_wire(update_info["ipc_handles"])}


class IpcWireExtension:
    """Mixed into each vLLM worker (`weight_transfer.EngineWorkerExtension`): the receiving half."""

    def rlhf_update_weights_from_wire(self, update_info: dict) -> None:
        """vLLM's `update_weights` with the handles of `update_info` rebuilt from their wire form."""
        self.update_weights({**update_info, "ipc_handles": handles_from_wire(update_info["ipc_handles"])})  # type: ignore[attr-defined]
