"""The worker's figures: on a CPU worker no GPU figure at all; on a GPU, NVML read on a thread
by the device's UUID, against a recorded NVML response set (no GPU here)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from rlhf_core.distributed.worker_meter import GpuSampler, WorkerMeter, device_uuid, open_gpu_sampler

GiB = 2**30


class RecordedNvml:
    """Two GPUs as NVML names them, each answering from a recorded series of readings (the last
    one repeats): GPU-a is NVML's index 0, GPU-b index 1."""

    def __init__(self, readings: dict[str, list[tuple[int, int]]], total: int = 80 * GiB):
        self.readings, self.total, self.reads = readings, total, {u: 0 for u in readings}
        self.initialised = False

    def nvmlInit(self):  # noqa: N802 - NVML's names
        self.initialised = True

    def nvmlDeviceGetHandleByUUID(self, uuid):  # noqa: N802
        name = uuid.decode() if isinstance(uuid, bytes) else uuid
        if name not in self.readings:
            raise RuntimeError(f"NVML_ERROR_NOT_FOUND: {name}")
        return name

    def _next(self, handle):
        series = self.readings[handle]
        reading = series[min(self.reads[handle], len(series) - 1)]
        self.reads[handle] += 1
        return reading

    def nvmlDeviceGetUtilizationRates(self, handle):  # noqa: N802
        return SimpleNamespace(gpu=self._next(handle)[0], memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle):  # noqa: N802
        series = self.readings[handle]
        used = series[max(0, min(self.reads[handle], len(series)) - 1)][1]
        return SimpleNamespace(used=used, total=self.total, free=self.total - used)


def test_a_cpu_worker_reports_no_gpu_figure_at_all():
    meter = WorkerMeter(use_gpu=False)
    with meter.compute():
        sum(range(10_000))
    figures = meter.figures(8)
    assert not [k for k in figures if k.startswith("gpu")], figures
    assert figures["samples_per_second"] > 0 and figures["step_seconds"] > 0


def test_the_sampler_reads_the_gpu_named_by_its_uuid_not_by_its_index():
    """A worker given CUDA_VISIBLE_DEVICES=1 sees GPU-b as its device 0: read by index it would
    report GPU-a's figures."""
    nvml = RecordedNvml({"GPU-a": [(100, 70 * GiB)], "GPU-b": [(20, 10 * GiB)]})
    sampler = open_gpu_sampler("GPU-b", nvml=nvml, every=3600)
    try:
        taken = sampler.take()
    finally:
        sampler.close()
    assert nvml.initialised and nvml.reads["GPU-a"] == 0 and sampler.uuid == "GPU-b"  # the label DCGM's series join
    assert taken == {"gpu_utilization": 0.2, "gpu_memory_used_bytes": 10 * GiB, "gpu_memory_total_bytes": 80 * GiB}


def test_a_step_reports_the_mean_utilisation_and_the_peak_memory_of_its_readings():
    nvml = RecordedNvml({"GPU-a": [(10, 1 * GiB), (90, 5 * GiB), (50, 3 * GiB), (0, 2 * GiB)]})
    sampler = GpuSampler(nvml, "GPU-a", every=3600)  # no reading from the thread within the test
    try:
        sampler.read()
        sampler.read()
        sampler.read()
        step = sampler.take()  # the fourth reading is take()'s own
        assert step["gpu_utilization"] == pytest.approx((10 + 90 + 50 + 0) / 400)
        assert step["gpu_memory_used_bytes"] == 5 * GiB
        assert sampler.take()["gpu_memory_used_bytes"] == 2 * GiB  # a new step: the old peak is gone
    finally:
        sampler.close()


def test_the_sampler_thread_reads_on_its_interval():
    nvml = RecordedNvml({"GPU-a": [(40, GiB)]})
    sampler = GpuSampler(nvml, "GPU-a", every=0.01)
    try:
        deadline = time.monotonic() + 5
        while nvml.reads["GPU-a"] < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        sampler.close()
    assert nvml.reads["GPU-a"] >= 5


def test_without_nvml_the_gpu_figures_are_left_out_and_said(caplog):
    nvml = RecordedNvml({"GPU-a": [(40, GiB)]})
    assert open_gpu_sampler("GPU-z", nvml=nvml) is None
    assert "NVML unavailable (NVML_ERROR_NOT_FOUND: GPU-z)" in caplog.text


@pytest.mark.parametrize("raw, name", [("5f2c-11aa", "GPU-5f2c-11aa"), ("GPU-5f2c", "GPU-5f2c"), ("MIG-77", "MIG-77")])
def test_torch_s_device_uuid_is_given_nvml_s_prefix(monkeypatch, raw, name):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid=raw))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert device_uuid() == name

