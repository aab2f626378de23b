"""What every training stage shares with its caller, whether it runs in-process (SFT) or on
Ray Train workers (reward model, policy, DPO/KTO): the callback it reports metrics through,
where it writes, and the failure it raises when it ran but its result is below the
configured bar."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# on_metrics(step, {name: value}): called on the driver (or in-process) as figures arrive
MetricsCallback = Callable[[int, dict[str, float]], None]


class StageFailed(RuntimeError):
    """A stage ran but its result is below the configured bar."""


@dataclass(frozen=True)
class StageSite:
    """Where a trainer's stage writes and reports. The model is saved to `out_dir`; Ray Train
    keeps runs and checkpoints under `storage_path / run_name`, and a run name that already
    holds a run is resumed, so give each pipeline run its own. `on_metrics(step, {...})` is
    called on the rank-0 worker, so it must pickle (e.g. `monitoring.sink.MlflowMetricsSink`);
    steps redone after a restart are reported again."""

    out_dir: Path
    storage_path: Path
    run_name: str
    on_metrics: MetricsCallback | None = None
