"""The torch process group of a training stage, kept on loopback when its workers share a node.

Ray Train's own set-up (`ray.train.torch.TorchConfig`) has rank 0 open torch's TCPStore on the
node's address, and the store's server listens on every interface with no authentication: any
host that can reach the machine can read and write the keys the workers rendezvous with. When
all workers run on one node (the local cluster `make demo` starts, or a single-node job), none
of that needs to leave the machine, so here rank 0 binds a socket to 127.0.0.1 itself and hands
it to the store (`master_listen_fd`), the other ranks connect to it there, and gloo's own
connections use the loopback interface (`GLOO_SOCKET_IFNAME=lo`, unless set). Workers spread
over several nodes must reach each other: they get Ray Train's set-up unchanged.

Uses Ray Train's torch backend internals (`_TorchBackend`, `_set_torch_distributed_env_vars`),
pinned with Ray in constraints.txt.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import ray
import torch.distributed as dist
from ray.train._internal.worker_group import WorkerGroup as V1WorkerGroup
from ray.train.torch import TorchConfig
from ray.train.torch.config import _set_torch_distributed_env_vars, _TorchBackend

LOOPBACK = "127.0.0.1"

_store = None  # rank 0: (listening socket, TCPStore server), alive as long as the process group


def _node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def _serve_store(world_size: int, timeout_s: int) -> int:
    """Rank 0: a TCPStore server on a socket bound to loopback; returns its port."""
    global _store
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore(LOOPBACK, port, world_size, True, timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=sock.fileno())
    _store = (sock, store)
    return port


def _join(backend: str, rank: int, world_size: int, port: int, timeout_s: int) -> None:
    """Every rank: the process group over the loopback store."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = LOOPBACK, str(port)
    timeout = timedelta(seconds=timeout_s)
    store = _store[1] if rank == 0 else dist.TCPStore(LOOPBACK, port, world_size, False, timeout)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _close_store() -> None:
    global _store
    if _store is not None:
        _store[0].close()
        _store = None


class _LoopbackBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config: TorchConfig):
        if len(set(worker_group.execute(_node_id))) > 1:  # across nodes: Ray Train's own set-up
            return super().on_start(worker_group, backend_config)
        gpus = worker_group.get_resources_per_worker().get("GPU", 0)
        backend = backend_config.backend or ("nccl" if gpus > 0 else "gloo")
        n, timeout_s = len(worker_group), backend_config.timeout_s
        port = worker_group.execute_single(0, _serve_store, n, timeout_s)
        if not isinstance(worker_group, V1WorkerGroup):
            worker_group.execute(_set_torch_distributed_env_vars)
        ray.get([worker_group.execute_single_async(i, _join, backend, i, n, port, timeout_s) for i in range(n)])

    def on_shutdown(self, worker_group, backend_config):
        super().on_shutdown(worker_group, backend_config)
        worker_group.execute_single(0, _close_store)


@dataclass
class LoopbackTorchConfig(TorchConfig):
    """`TorchConfig` whose process group stays on loopback when all workers share a node."""

    @property
    def backend_cls(self):
        return _LoopbackBackend
