"""What the distributed stages get as `on_metrics` in tests and benchmarks: it runs on rank 0
of a Ray Train worker, so it must pickle, and it writes where the caller can read it afterwards."""
from __future__ import annotations

import json
from pathlib import Path


class JsonlSink:
    """A picklable on_metrics callback that appends `{"step": s, **metrics}` lines to a file.
    Every figure is kept, the workers' hosts and pids (strings) included; a value JSON cannot
    hold is written as its `str`."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}, default=str) + "\n")
