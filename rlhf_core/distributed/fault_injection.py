"""Faults the tests inject into a run, all through one switch, $RLHF_FAULT, parsed once a
process and said loudly when set: a worker that dies once at a step, a loss that turns NaN
once, a pipeline process killed at a named point, a stage held at its first checkpoint for a
kill from outside, a run waiting at a named point for the test's go, a step that silently
does not do its work (a weight sync that leaves the engine as it was). A production run leaves
it unset (a deployment's run refuses it), and none of this code acts; the trainers take no
parameter for it. `fit_stage` hands the variable to the stage's Ray workers."""
from __future__ import annotations

import functools
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

FAULT_ENV = "RLHF_FAULT"
FORMS = "kill:POINT[=FILE], hold:POINT, nan:POINT, skip:POINT or wait:POINT=FILE"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fault:
    """What $RLHF_FAULT arms: at `point`, `kill` (SIGKILL this process; with a `release` file,
    once: the file is made as it fires, and a retried worker lives), `hold` (stop for good, so
    that a kill from outside lands there however fast the stage runs), `nan` (the next loss a
    training worker backpropagates is NaN), `skip` (the work at `point` is not done, and nothing
    says so: `skipped`) or `wait` (say so, `release`.waiting appears, and go
    on once `release` exists, so that a test can order what two concurrent runs do next)."""

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
    if action not in ("kill", "hold", "nan", "skip", "wait") or not point or (action == "wait" and not release) \
            or (action in ("hold", "nan", "skip") and release):
        raise ValueError(f"${FAULT_ENV}={value!r}: expected {FORMS}")
    fault = Fault(action, point, Path(release) if release else None)
    log.warning("fault injection armed ($%s=%s): this process will %s at %s", FAULT_ENV, value, action, point)
    return fault


def armed() -> Fault | None:
    return parse(os.environ.get(FAULT_ENV))


def worker_point(stage: str, step: int, rank: int) -> str:
    """A training worker's point, right after optimizer step `step`: `reward:step3:rank1`."""
    return f"{stage}:step{step}:rank{rank}"


class NanOnce:
    """Wraps a BackwardAndStep to add NaN to the next loss it sees, once."""

    def __init__(self, inner):
        self.inner, self.armed = inner, True

    def __call__(self, loss, boundary):
        if self.armed:
            self.armed, loss = False, loss + float("nan")
        return self.inner(loss, boundary)


def nan_if_due(backward_and_step, point: str):
    """`backward_and_step`, poisoned once if $RLHF_FAULT is `nan:point`."""
    fault = armed()
    return NanOnce(backward_and_step) if fault is not None and fault == Fault("nan", point) else backward_and_step


def skipped(point: str) -> bool:
    """Whether $RLHF_FAULT is `skip:point`: the caller then leaves out its work at `point`
    (`policy:sync`: every weight sync of the policy stage, on every rank)."""
    return armed() == Fault("skip", point)


def fault_point(point: str, wait_s: float = 900) -> None:
    """Where the tests stop or order a run, through $RLHF_FAULT alone. The points: `<stage>:end`
    (a stage's work done, its MLflow run not yet closed), `<stage>:returned` (its task returned,
    the journal not yet written), `<stage>:checkpoint` (a training worker, once the stage's first
    checkpoint is committed), `worker_point`s (`<stage>:writing`'s: a rank's part of a checkpoint
    written, not yet reported), and `register:promote` (a passing candidate
    registered, its promotion not yet tried)."""
    fault = armed()
    if fault is None or fault.point != point or fault.action in ("nan", "skip"):
        return
    if fault.action == "kill":
        if fault.release is not None:
            if fault.release.exists():
                return
            fault.release.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    while fault.action == "hold":
        time.sleep(60)
    Path(f"{fault.release}.waiting").touch()
    deadline = time.monotonic() + wait_s
    while not fault.release.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{FAULT_ENV}: {fault.release} did not appear within {wait_s:.0f} s")
        time.sleep(0.2)
