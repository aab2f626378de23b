"""Tensor collectives whose tensors live on a device their group's backend serves.

NCCL serves CUDA tensors only, gloo CPU tensors; a group made with "cpu:gloo,cuda:nccl" serves
both. Handed a CPU tensor, an NCCL group raises (or hangs) on a GPU machine, while the CPU suite,
on gloo, never sees it. So every tensor collective of the trainers goes through `all_reduce`
here, which checks the tensor's device against its group's backend first (`check_device`), and
the CPU tests can hand the same code an NCCL group that refuses what NCCL would refuse.

Bookkeeping that lives on the host (sums of Python floats, counts) reduces over `host_group()`:
the default group where it serves CPU tensors, else a gloo group beside it, made once per
process (every rank must ask for it at the same point, as for any new group).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_host_groups: dict[int, object] = {}  # id(default group) -> its gloo companion


class CollectiveDeviceError(RuntimeError):
    """A tensor on a device its group's backend does not serve."""


def served_devices(backend: str) -> frozenset[str]:
    """Device types a backend string serves: "nccl" -> {cuda}, "gloo" -> {cpu},
    "cpu:gloo,cuda:nccl" -> {cpu, cuda}."""
    backend = str(backend).lower()
    if ":" in backend:
        return frozenset(part.split(":", 1)[0].strip() for part in backend.split(","))
    return frozenset({"nccl": {"cuda"}, "gloo": {"cpu"}, "mpi": {"cpu", "cuda"}}.get(backend, {"cpu"}))


def check_device(tensor: torch.Tensor, backend: str, what: str = "a collective") -> None:
    """Raise `CollectiveDeviceError` when `backend` does not serve `tensor`'s device."""
    if tensor.device.type not in served_devices(backend):
        raise CollectiveDeviceError(
            f"{what}: a {tensor.device.type} tensor on a {backend} process group, which serves "
            f"{' and '.join(sorted(served_devices(backend)))} tensors only: put it on the group's device, "
            "or reduce host-side figures over collectives.host_group()")


def all_reduce(tensor: torch.Tensor, group=None, what: str = "all_reduce") -> None:
    """`dist.all_reduce` (sum, in place) after `check_device` against the group's backend."""
    check_device(tensor, dist.get_backend(group), what)
    dist.all_reduce(tensor, group=group)


def host_group():
    """A group that serves CPU tensors: the default group where its backend does, else a gloo
    group over the same ranks, made on first use."""
    if "cpu" in served_devices(dist.get_backend()):
        return None
    key = id(dist.group.WORLD)
    if key not in _host_groups:
        _host_groups[key] = dist.new_group(backend="gloo")
    return _host_groups[key]
