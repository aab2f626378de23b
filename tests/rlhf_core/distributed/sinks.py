"""What the distributed stages' tests give as `on_metrics`: it runs on rank 0 of a Ray Train
worker, so it must pickle, and it writes where the test can read it afterwards."""
from __future__ import annotations

import json
from pathlib import Path


class JsonlSink:
    """A picklable on_metrics callback that appends `{"step": s, **metrics}` lines to a file."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
