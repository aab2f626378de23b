"""Per-worker figures of one training step, for spotting imbalance across Ray workers.

Each worker measures its own step and the step's figures travel with the metrics rank 0
already gathers, as flat `worker/<rank>/<figure>` keys (plus `worker/<rank>/host`):

    cpu_utilization      process CPU time / wall time over the step (all of the worker's
                         threads: above 1 with several busy threads)
    step_seconds         wall time of the step on this worker
    samples_per_second   samples / seconds of the worker's own compute (the forward passes),
                         excluding waits in collectives: in a synchronous step every worker's
                         wall time is the slowest one's, so only the compute time shows which
                         worker is the straggler. On a GPU the stretch is closed by a CUDA
                         synchronisation: it times the kernels, not their launches
    host, node, pid      where the worker runs: host name, Ray node id, process id (strings:
                         labels, not figures; two nodes on one host differ only by node)

On a GPU, besides (absent on a CPU worker, not zero):

    gpu_utilization          the step's mean of NVML's utilisation of the worker's GPU, read
                             every `GPU_SAMPLE_S` on a thread (`GpuSampler`), the device found by
                             its UUID so that it follows CUDA_VISIBLE_DEVICES; needs pynvml
    gpu_memory_used_bytes    the largest memory in use on that GPU during the step (all its
                             processes: a colocated engine's too), and gpu_memory_total_bytes
    gpu_max_allocated_bytes, gpu_max_reserved_bytes
                             torch's high-water marks in this process during the step
    gpu_uuid                 the GPU's NVML name (a label, like host): DCGM's series carry it
"""
from __future__ import annotations

import logging
import os
import resource
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any

GPU_SAMPLE_S = 0.2  # how often the sampler reads NVML
log = logging.getLogger(__name__)


class WorkerMeter:
    def __init__(self, use_gpu: bool = False):
        self.host = socket.gethostname()
        self.node = _ray_node_id()
        self.use_gpu = use_gpu
        self._gpu = open_gpu_sampler() if use_gpu else None
        self.start()

    def start(self) -> None:
        """Begin a step: reset the clocks (and torch's memory high-water marks)."""
        if self.use_gpu:
            import torch  # noqa: PLC0415

            torch.cuda.reset_peak_memory_stats()
            if self._gpu is not None:
                self._gpu.take()  # the previous step's readings are not this step's
        self._wall0, self._cpu0 = time.perf_counter(), time.process_time()
        self.compute_s = 0.0

    @contextmanager
    def compute(self):
        """Time a stretch of this worker's own compute (no collectives inside)."""
        synchronise(self.use_gpu)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            synchronise(self.use_gpu)
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
        if self.use_gpu:
            import torch  # noqa: PLC0415

            out["gpu_max_allocated_bytes"] = float(torch.cuda.max_memory_allocated())
            out["gpu_max_reserved_bytes"] = float(torch.cuda.max_memory_reserved())
        if self._gpu is not None:
            out |= self._gpu.take() | {"gpu_uuid": self._gpu.uuid}  # a label: joins DCGM's series
        return out


def synchronise(use_gpu: bool) -> None:
    """Wait for this process's queued CUDA work (on a GPU worker): what a host clock read next times."""
    if use_gpu:
        import torch  # noqa: PLC0415

        torch.cuda.synchronize()


class GpuSampler:
    """One GPU read through NVML every `every` seconds on a daemon thread. `take()` gives the
    mean utilisation and the largest memory in use since the last `take()` (one reading at
    least: it reads once itself), and the device's total memory."""

    def __init__(self, nvml: Any, handle: Any, every: float = GPU_SAMPLE_S, uuid: str = ""):
        self.nvml, self.handle, self.uuid = nvml, handle, uuid
        self.total = float(nvml.nvmlDeviceGetMemoryInfo(handle).total)
        self._lock = threading.Lock()
        self._utilisation: list[float] = []
        self._peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), name="gpu-sampler", daemon=True)
        self._thread.start()

    def read(self) -> None:
        utilisation = self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu / 100.0
        used = float(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)
        with self._lock:
            self._utilisation.append(utilisation)
            self._peak = max(self._peak, used)

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.read()
            except Exception as exc:  # noqa: BLE001 - a failing reader stops; take() still reads once a step
                log.warning("GPU sampler: NVML read failed (%s); sampling once a step from now on", exc)
                return

    def take(self) -> dict[str, float]:
        self.read()
        with self._lock:
            readings, peak = self._utilisation, self._peak
            self._utilisation, self._peak = [], 0.0
        return {"gpu_utilization": sum(readings) / len(readings), "gpu_memory_used_bytes": peak,
                "gpu_memory_total_bytes": self.total}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


def device_uuid(index: int | None = None) -> str:
    """NVML's name (`GPU-...`) of this process's CUDA device `index` (default: the current one),
    as CUDA_VISIBLE_DEVICES maps it: device 0 of a worker given GPU 5 is GPU 5."""
    import torch  # noqa: PLC0415

    raw = str(torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).uuid)
    return raw if raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}"


def open_gpu_sampler(uuid: str | None = None, nvml: Any = None, every: float = GPU_SAMPLE_S) -> GpuSampler | None:
    """A sampler of the GPU named `uuid` (default: this process's current device), or None when
    NVML cannot be read (no pynvml, no driver): the GPU figures are then left out."""
    try:
        if nvml is None:
            import pynvml as nvml  # noqa: PLC0415
        nvml.nvmlInit()
        # bytes: nvidia-ml-py before 11.5 hands the argument to ctypes as it is
        uuid = uuid or device_uuid()
        return GpuSampler(nvml, nvml.nvmlDeviceGetHandleByUUID(uuid.encode("ascii")), every, uuid)
    except Exception as exc:  # noqa: BLE001 - no NVML: the GPU figures are left out, nothing else changes
        log.warning("GPU sampler: NVML unavailable (%s); the GPU utilisation and memory figures are left out", exc)
        return None


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

        if ray.is_initialized():  # asking an uninitialised Ray starts a cluster
            return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside a Ray worker, or no Ray
        pass
    return "local"
