"""The order the suite runs its modules in: the slowest first, from the last measured full run."""
from __future__ import annotations

import json
from pathlib import Path

DURATIONS = Path(__file__).resolve().parents[2] / "bench" / "results" / "test_durations.json"  # bench/test_durations.py


def module_seconds(path: Path = DURATIONS) -> dict[str, float]:
    """Seconds per test module in the last measured full run (bench/test_durations.py); {} if none."""
    try:
        return {row["module"]: row["total"] for row in json.loads(path.read_text())["modules"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def longest_modules_first(items: list, seconds: dict[str, float]) -> None:
    """Reorder `items` in place, slowest module first (by `seconds`; an unmeasured module counts
    as 0), keeping each module's tests together and in their order. `make test` hands whole
    modules to its pytest-xdist workers in this order (`--dist loadfile`), so the long modules
    start first and do not leave one worker busy at the end while the other idles."""
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))
