"""Prometheus export around a training stage: one `JobExporter` per job while it runs."""
from __future__ import annotations

from contextlib import contextmanager

from monitoring.prometheus import FanOut, JobExporter
from rlhf_core.config import PipelineConfig
from rlhf_core.training.circuit_breaker import CircuitBreakerTripped


@contextmanager
def exported(cfg: PipelineConfig, run_id: str, stage: str, sink, kl_bound: float | None = None, progress=None):
    """Yield the metrics callback for the job: `sink` (MLflow), plus the job's Prometheus
    endpoint when `monitoring.enabled`; the endpoint also hands every step it receives to
    `progress` in this process (the workers' metrics reach the driver only through it). When the job fails the endpoint stays up
    `monitoring.linger_on_failure_s` seconds with `rlhf_train_running 0` (and the circuit
    breaker's reason), so Prometheus scrapes the end and its alerts can fire."""
    m = cfg.monitoring
    if not m.enabled:
        yield sink
        return
    exporter = JobExporter(run_id, stage, host=m.host, port=m.port, advertise_host=m.advertise_host,
                           targets_dir=m.targets_dir or cfg.output_dir / "prometheus-targets", kl_bound=kl_bound,
                           on_record=progress)
    try:
        yield FanOut(sink, exporter.sink())
    except CircuitBreakerTripped as exc:
        exporter.finish(ok=False, trip_reason=exc.trip.reason)
        exporter.close(m.linger_on_failure_s)
        raise
    except BaseException:
        exporter.finish(ok=False)
        exporter.close(m.linger_on_failure_s)
        raise
    exporter.finish(ok=True)
    exporter.close()
