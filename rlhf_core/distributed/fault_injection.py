"""Faults the tests inject into a training run: a worker that dies once, a loss that turns NaN
once, a pipeline process killed at a named point, a stage held at its first checkpoint for a
kill from outside, a run waiting at a named point for the test's go. The trainers take theirs
as keyword-only `_`-prefixed arguments; a production run passes None (and sets none of the
$RLHF_FAULT_* variables), and none of this code acts."""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KillWorkerOnce:
    """The worker of `rank` SIGKILLs itself right after optimizer step `at_step`, unless
    `marker` exists (it creates it first, so the retried worker lives)."""

    rank: int
    at_step: int
    marker: Path


def kill_if_due(kill: KillWorkerOnce | None, rank: int, step: int) -> None:
    """Die here if `kill` names this rank and step and has not fired yet."""
    if kill is not None and kill.rank == rank and kill.at_step == step and not kill.marker.exists():
        kill.marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class NanAtStep:
    """Rank `rank` adds NaN to its first micro-batch loss of RL step `step`."""

    rank: int
    step: int


class NanOnce:
    """Wraps a BackwardAndStep to add NaN to the next loss it sees, once."""

    def __init__(self, inner):
        self.inner, self.armed = inner, True

    def __call__(self, loss, boundary):
        if self.armed:
            self.armed, loss = False, loss + float("nan")
        return self.inner(loss, boundary)


def nan_if_due(backward_and_step, nan_at: NanAtStep | None, rank: int, step: int):
    """`backward_and_step`, poisoned once if `nan_at` names this rank and step."""
    if nan_at is not None and nan_at.rank == rank and nan_at.step == step:
        return NanOnce(backward_and_step)
    return backward_and_step


FAULT_ENV = "RLHF_FAULT_KILL_AT"


def fault_point(point: str) -> None:
    """Fault injection for the resume tests: SIGKILL this process when $RLHF_FAULT_KILL_AT names
    `point`. The points: `<stage>:end` (a stage's work done, its MLflow run not yet closed) and
    `<stage>:returned` (its task returned, the journal not yet written)."""
    if os.environ.get(FAULT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


HOLD_ENV = "RLHF_FAULT_HOLD_AT"


def hold_point(point: str) -> None:
    """Fault injection for the resume tests: when $RLHF_FAULT_HOLD_AT names `point`, stop here
    for good, so that a kill from outside lands at this point however fast the stage trains.
    The point: `<stage>:checkpoint` (a training worker, once the stage's first checkpoint is
    committed). Ray's workers inherit the variable from the process that starts the cluster."""
    if os.environ.get(HOLD_ENV) == point:
        while True:
            time.sleep(60)


WAIT_ENV = "RLHF_FAULT_WAIT_AT"


def wait_point(point: str, timeout_s: float = 900) -> None:
    """Fault injection for the concurrency tests: when $RLHF_FAULT_WAIT_AT is `point=FILE`, say
    so (FILE.waiting appears) and wait until FILE exists, so that a test can order what two
    concurrent runs do next. The point: `register:promote` (a passing candidate registered,
    its promotion not yet tried)."""
    name, _, release = os.environ.get(WAIT_ENV, "").partition("=")
    if name != point or not release:
        return
    Path(f"{release}.waiting").touch()
    deadline = time.monotonic() + timeout_s
    while not Path(release).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{WAIT_ENV}: {release} did not appear within {timeout_s:.0f} s")
        time.sleep(0.2)
