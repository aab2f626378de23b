"""What every training stage shares with its caller, whether it runs in-process (SFT) or on
Ray Train workers (reward model, policy, DPO/KTO): the callback it reports metrics through,
and the failure it raises when it ran but its result is below the configured bar."""
from __future__ import annotations

from collections.abc import Callable

# on_metrics(step, {name: value}): called on the driver (or in-process) as figures arrive
MetricsCallback = Callable[[int, dict[str, float]], None]


class StageFailed(RuntimeError):
    """A stage ran but its result is below the configured bar."""
