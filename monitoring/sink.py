"""The one place where flat `stage/name` metric dicts produced by core code are sent out.

Core training loops call a `MetricsCallback(step, metrics)`; this module turns such a
callback into MLflow logging (and, later, Prometheus export) without the core knowing.
"""
from __future__ import annotations

import math
import time

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient


class MlflowMetricsSink:
    """Logs `(step, {"stage/name": value})` to one MLflow run, skipping non-finite values."""

    def __init__(self, client: MlflowClient, run_id: str):
        self.client = client
        self.run_id = run_id

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [
            Metric(key=k, value=float(v), timestamp=now, step=step)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and math.isfinite(v)
        ]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)
