"""Faults the tests inject into a training run: a worker that dies once, a loss that turns NaN
once, a pipeline process killed at a named point, a stage held at its first checkpoint for a
kill from outside, a run waiting at a named point for the test's go. The trainers take theirs
as keyword-only `_`-prefixed arguments; the pipeline's points read one switch, $RLHF_FAULT, which
a production run leaves unset (a deployment's run refuses it), and none of this code acts."""
from __future__ import annotations

import functools
import logging
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


FAULT_ENV = "RLHF_FAULT"
FORMS = "kill:POINT, hold:POINT or wait:POINT=FILE"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fault:
    """What $RLHF_FAULT arms: at `point`, `kill` (SIGKILL this process), `hold` (stop for good,
    so that a kill from outside lands there however fast the stage runs) or `wait` (say so,
    `release`.waiting appears, and go on once `release` exists, so that a test can order what
    two concurrent runs do next)."""

    action: str
    point: str
    release: Path | None = None


@functools.lru_cache(maxsize=4)
def parse(value: str | None) -> Fault | None:
    """The fault a value of $RLHF_FAULT arms (None: unset or empty), said loudly once a process."""
    if not value:
        return None
    action, _, rest = value.partition(":")
    point, _, release = rest.partition("=")
    if action not in ("kill", "hold", "wait") or not point or (action == "wait") != bool(release):
        raise ValueError(f"${FAULT_ENV}={value!r}: expected {FORMS}")
    fault = Fault(action, point, Path(release) if release else None)
    log.warning("fault injection armed ($%s=%s): this process will %s at %s", FAULT_ENV, value, action, point)
    return fault


def armed() -> Fault | None:
    return parse(os.environ.get(FAULT_ENV))


def fault_point(point: str, wait_s: float = 900) -> None:
    """Where the resume and concurrency tests stop or order a run, through $RLHF_FAULT alone. The
    points: `<stage>:end` (a stage's work done, its MLflow run not yet closed), `<stage>:returned`
    (its task returned, the journal not yet written), `<stage>:checkpoint` (a training worker, once
    the stage's first checkpoint is committed; Ray's workers inherit the variable from the process
    that starts the cluster) and `register:promote` (a passing candidate registered, its promotion
    not yet tried)."""
    fault = armed()
    if fault is None or fault.point != point:
        return
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while fault.action == "hold":
        time.sleep(60)
    Path(f"{fault.release}.waiting").touch()
    deadline = time.monotonic() + wait_s
    while not fault.release.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{FAULT_ENV}: {fault.release} did not appear within {wait_s:.0f} s")
        time.sleep(0.2)
