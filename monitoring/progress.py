"""Live progress of a long stage on the terminal: step k of n, elapsed and remaining time, and
the stage's key figure, fed by the same flat `stage/name` metric callbacks as MLflow.

SFT trains in the task's process and calls the sink directly. The reward and policy stages
train on Ray workers; their rank 0 sends each step to the job's `JobExporter` in the task's
process, which hands it on here (`on_record`), so those bars need `monitoring.enabled`.

Quiet (a no-op) in CI (`CI` set) and when stdout is not a terminal: logs and MLflow already
carry the figures there, and a redrawn bar would only fill log files with control codes.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def wanted() -> bool:
    """A person is watching: stdout is a terminal and this is not CI."""
    return sys.stdout.isatty() and not os.environ.get("CI")


class ProgressSink:
    """A metrics callback that advances one progress bar to `step` of `total` and shows the
    `figures` (metric key -> label) it has seen last. Use it as a context manager."""

    def __init__(self, stage: str, total: int, figures: Mapping[str, str], enabled: bool | None = None):
        self.stage, self.total, self.figures = stage, total, dict(figures)
        self.enabled = wanted() if enabled is None else enabled
        self.shown: dict[str, float] = {}
        self._progress: Progress | None = None
        self._task = None

    def __enter__(self) -> ProgressSink:
        if self.enabled:
            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                                      TextColumn("{task.fields[figures]}"), transient=False)
            self._progress.start()
            self._task = self._progress.add_task(self.stage, total=self.total, figures="")
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def __call__(self, step: int, metrics: Mapping[str, float]) -> None:
        self.shown.update({k: float(v) for k, v in metrics.items() if k in self.figures})
        if self._progress is not None:
            self._progress.update(self._task, completed=min(step, self.total), figures=self.text())

    def text(self) -> str:
        """`loss 0.4213  ...`: the figures seen so far, in the order they were named."""
        return "  ".join(f"{label} {self.shown[key]:.4g}" for key, label in self.figures.items() if key in self.shown)
