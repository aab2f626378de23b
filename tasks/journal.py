"""The stage journal: what a pipeline run's completed stages returned, kept in its output
directory so that a rerun of the run (`rlhf run --resume RUN_ID`, or a retry from the Prefect
UI) reuses them instead of running them again.

One file per completed stage task, `<out_dir>/stages/<task name>.pkl`, written atomically after
the task returned: a run killed at any moment leaves every entry whole or absent. An entry is
reused only while the files its result points at (`result.path`) still exist; otherwise the
stage runs again. A stage killed midway has no entry and runs again; the training stages then
continue from their last Ray Train checkpoint (their Ray run names are fixed per pipeline run).
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any


class Stages(dict):
    """The summary's per-stage records (`{stage: summary}`), with the journal beside them."""

    def __init__(self, journal_dir: Path):
        super().__init__()
        self.journal_dir = Path(journal_dir)

    def _entry(self, task_name: str) -> Path:
        return self.journal_dir / f"{task_name}.pkl"

    def completed(self, task_name: str) -> Any | None:
        """The result `task_name` returned in an earlier attempt of this run, or None (it never
        completed, or the files its result points at are gone)."""
        entry = self._entry(task_name)
        if not entry.exists():
            return None
        with open(entry, "rb") as f:
            result = pickle.load(f)
        path = getattr(result, "path", None)
        if isinstance(path, Path) and not path.exists():
            return None
        return result

    def record(self, task_name: str, result: Any) -> None:
        """Journal `result` as `task_name`'s, atomically (temporary file, fsync, rename)."""
        self.journal_dir.mkdir(parents=True, exist_ok=True)
        entry = self._entry(task_name)
        tmp = entry.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, entry)
