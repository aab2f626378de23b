"""Asking a running stage to stop cleanly, through its MLflow run.

Whoever wants a run stopped (the alert receiver for an alert labelled `action: stop`, or a
person) calls `request_stop`, which sets the tag `rlhf.stop_requested` on the stage's MLflow run
(the `run` label of the training metrics) to `{"reason", "requested_by", "at"}`. The stage reads
it through `StopRequests`, its `StageSite.stop_requested`: rank 0 looks between steps, at most
every `POLL_S` seconds, and a stage that honours it (the RL policy stage) saves a checkpoint of
the step it finished and ends with `StageStopped`; a resume continues from that checkpoint.
A request made before the stage started is not its own and is ignored.
"""
from __future__ import annotations

import json
import time

from mlflow.tracking import MlflowClient

STOP_TAG = "rlhf.stop_requested"
POLL_S = 5.0  # the longest a request waits to be read, besides the step it arrives in


def request_stop(tracking_uri: str, run_id: str, reason: str, requested_by: str) -> None:
    """Ask the stage logging to MLflow run `run_id` to stop after its current step."""
    value = json.dumps({"reason": reason, "requested_by": requested_by, "at": time.time()})
    MlflowClient(tracking_uri).set_tag(run_id, STOP_TAG, value[:5000])


class StopRequests:
    """`stop_requested()` of a stage logging to MLflow run `run_id`: the reason of a request
    made since `since` (epoch seconds; default now), else None. It holds only the URI, the run
    and the times, so it pickles to the rank-0 worker."""

    def __init__(self, tracking_uri: str, run_id: str, since: float | None = None, poll_s: float = POLL_S):
        self.tracking_uri, self.run_id = tracking_uri, run_id
        self.since = time.time() if since is None else since
        self.poll_s = poll_s
        self._last_read = -float("inf")

    def __call__(self) -> str | None:
        now = time.monotonic()
        if now - self._last_read < self.poll_s:
            return None
        self._last_read = now
        raw = MlflowClient(self.tracking_uri).get_run(self.run_id).data.tags.get(STOP_TAG)
        if raw is None:
            return None
        try:
            request = json.loads(raw)
            at, reason, by = float(request["at"]), str(request["reason"]), str(request["requested_by"])
        except (ValueError, KeyError, TypeError):
            return f"{STOP_TAG} = {raw[:200]!r} (not the JSON request_stop writes)"
        return None if at < self.since else f"{reason} (requested by {by})"
