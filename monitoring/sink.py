"""The one place where flat `stage/name` metric dicts produced by core code are sent out.

Core training loops call a `MetricsCallback(step, metrics)`; this module turns such a
callback into MLflow logging (and, later, Prometheus export) without the core knowing.
"""
from __future__ import annotations

import time

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient


class MlflowMetricsSink:
    """Logs `(step, {"stage/name": value})` to one MLflow run. NaN is logged as NaN: a
    diverging loss must show up in the run, not vanish from it.

    It holds only the tracking URI and run id, so it pickles: a Ray Train worker (rank 0)
    can log through it directly while the core loop never imports MLflow.
    """

    def __init__(self, tracking_uri: str, run_id: str):
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self._client: MlflowClient | None = None

    @property
    def client(self) -> MlflowClient:
        if self._client is None:
            self._client = MlflowClient(self.tracking_uri)
        return self._client

    def __getstate__(self) -> dict:
        return {"tracking_uri": self.tracking_uri, "run_id": self.run_id, "_client": None}

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [
            Metric(key=k, value=float(v), timestamp=now, step=step)
            for k, v in metrics.items()
            if isinstance(v, (int, float))
        ]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)
