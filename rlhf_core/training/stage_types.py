"""What every training stage shares with its caller, whether it runs in-process (SFT) or on
Ray Train workers (reward model, policy, DPO/KTO): the callback it reports metrics through,
where it writes, and the failure it raises when it ran but its result is below the
configured bar."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlhf_core.models.gpu_room import GpuNeed

# on_metrics(step, {name: value}): called on the driver (or in-process) as figures arrive
MetricsCallback = Callable[[int, dict[str, float]], None]
# stop_requested(): why someone outside asks the stage to stop (an alert, a person), else None
StopCheck = Callable[[], "str | None"]


class StageFailed(RuntimeError):
    """A stage ran but its result is below the configured bar."""


class StageStopped(StageFailed):
    """The stage stopped between two steps because it was asked to (`StageSite.stop_requested`),
    after a checkpoint of the last step it finished: a resume continues from `checkpoint_path`."""

    def __init__(self, stage: str, step: int, reason: str, checkpoint_path: str | None):
        super().__init__(f"{stage}: stopped on request after step {step} ({reason}); checkpoint to resume from: "
                         f"{checkpoint_path or 'none'}")
        self.step, self.reason, self.checkpoint_path = step, reason, checkpoint_path


@dataclass(frozen=True)
class StageSite:
    """Where a trainer's stage writes and reports. The model is saved to `out_dir`; Ray Train
    keeps runs and checkpoints under `storage_path / run_name`, and a run name that already
    holds a run is resumed, so give each pipeline run its own. `on_metrics(step, {...})` is
    called on the rank-0 worker, so it must pickle (e.g. `monitoring.sink.MlflowMetricsSink`);
    steps redone after a restart are reported again. `stop_requested()`, also called on rank 0
    (between steps, so it must pickle and be cheap), asks a training stage (reward, policy,
    DPO/KTO) to stop cleanly with a checkpoint (`StageStopped`); `monitoring.stop` reads it from
    the stage's MLflow run. With `gpu_need` (`rlhf_core.models.gpu_room.GpuNeed`), every rank of
    a stage on GPUs checks that its GPU has that much free before it loads anything."""

    out_dir: Path
    storage_path: Path
    run_name: str
    on_metrics: MetricsCallback | None = None
    stop_requested: StopCheck | None = None
    gpu_need: GpuNeed | None = None
