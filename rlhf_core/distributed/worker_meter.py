"""Per-worker figures of one training step, for spotting imbalance across Ray workers.

Each worker measures its own step and the step's figures travel with the metrics rank 0
already gathers, as flat `worker/<rank>/<figure>` keys (plus `worker/<rank>/host`):

    cpu_utilization      process CPU time / wall time over the step (all of the worker's
                         threads: above 1 with several busy threads)
    step_seconds         wall time of the step on this worker
    samples_per_second   samples / seconds of the worker's own compute (the forward passes),
                         excluding waits in collectives: in a synchronous step every worker's
                         wall time is the slowest one's, so only the compute time shows which
                         worker is the straggler
    host, node, pid      where the worker runs: host name, Ray node id, process id (strings:
                         labels, not figures; two nodes on one host differ only by node)
    gpu_utilization, gpu_memory_used_bytes
                         the worker's GPU through NVML, when it has one and pynvml is installed
"""
from __future__ import annotations

import os
import resource
import socket
import sys
import time
from contextlib import contextmanager
from typing import Any


class WorkerMeter:
    def __init__(self, use_gpu: bool = False):
        self.host = socket.gethostname()
        self.node = _ray_node_id()
        self._nvml = _nvml_handle() if use_gpu else None
        self.start()

    def start(self) -> None:
        """Begin a step: reset the clocks."""
        self._wall0, self._cpu0 = time.perf_counter(), time.process_time()
        self.compute_s = 0.0

    @contextmanager
    def compute(self):
        """Time a stretch of this worker's own compute (no collectives inside)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.compute_s += time.perf_counter() - t0

    def figures(self, samples: int) -> dict[str, Any]:
        wall = max(time.perf_counter() - self._wall0, 1e-9)
        out: dict[str, Any] = {
            "host": self.host,
            "node": self.node,
            "pid": str(os.getpid()),
            "cpu_utilization": (time.process_time() - self._cpu0) / wall,
            "step_seconds": wall,
            "samples_per_second": samples / self.compute_s if self.compute_s > 0 else float("nan"),
        }
        if self._nvml is not None:
            import pynvml  # noqa: PLC0415

            out["gpu_utilization"] = pynvml.nvmlDeviceGetUtilizationRates(self._nvml).gpu / 100.0
            out["gpu_memory_used_bytes"] = float(pynvml.nvmlDeviceGetMemoryInfo(self._nvml).used)
        return out


def peak_rss_gib() -> float:
    """This process's largest resident memory so far, in GiB (the kernel's high-water mark: every
    transient tensor counted, whatever the allocator later gave back)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return round(peak / (2**30 if sys.platform == "darwin" else 2**20), 2)


def flatten_workers(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """[{figure: value} for each rank] -> {"worker/<rank>/<figure>": value}."""
    return {f"worker/{rank}/{k}": v for rank, figures in enumerate(per_rank) for k, v in figures.items()}


def _ray_node_id() -> str:
    try:
        import ray  # noqa: PLC0415

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside a Ray worker
        return "local"


def _nvml_handle():
    try:
        import pynvml  # noqa: PLC0415
        import torch  # noqa: PLC0415

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - no NVML: the GPU figures are left out, nothing else changes
        return None
