"""The checks a gate decision is made of, and the rules that judge one figure or interval.

`gate` (`rlhf_core.eval.gates`) composes these: each rule returns a `Check` that passed, failed
with a `reason` (`code: explanation`, with the numbers), was skipped, or is undecided (an
interval that straddles its bar), and `Decision.from_checks` turns the checks into a verdict.

Rules on intervals (paired bootstrap, `rlhf_core.eval.confidence`):

    better_than      passes when the low end is above the bar, fails when the high end is
                     below the rejection line (the bar, or the bar less a margin)
    not_worse_than   non-inferiority: passes when the low end is at least the bar, fails when
                     the high end is below it
    not_above        passes when the high end is at most the bar, fails when the low end is above it

and on point estimates `at_least` / `at_most`. A value equal to its bar passes (up to
`TOLERANCE`, so `0.8 - 0.1` does not reject an accuracy of exactly 0.7); a NaN fails.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from rlhf_core.eval.confidence import Interval, prompts_to_decide

TOLERANCE = 1e-9


@dataclass(frozen=True)
class Check:
    """One gate check. `op` says how `observed` must compare with `threshold` to pass.

    A skipped check passes, has no observed value nor threshold, and says why in `skipped`.
    `reason` is the rejection line (`code: explanation`) when the check failed, else None.
    An undecided check has not passed, has no `reason`, and says why in `undecided`; `low`
    and `high` are the interval it was judged on, if any.
    """

    name: str
    passed: bool
    observed: float | None
    threshold: float | None
    op: Literal[">=", "<="]
    skipped: str | None = None
    reason: str | None = None
    undecided: str | None = None
    low: float | None = None
    high: float | None = None


@dataclass(frozen=True)
class Decision:
    """The gate's verdict: `passed` iff every check passed; one `reasons` line per failed
    check, one `undecided` line per check the evidence does not settle either way.
    `status`: "passed", "rejected" (a check failed) or "undecided" (none failed, some open)."""

    passed: bool
    reasons: tuple[str, ...]
    checks: tuple[Check, ...]
    undecided: tuple[str, ...] = ()

    @classmethod
    def from_checks(cls, checks: tuple[Check, ...]) -> "Decision":
        failed = tuple(c.reason for c in checks if not c.passed and c.undecided is None)
        undecided = tuple(c.undecided for c in checks if c.undecided is not None)
        return cls(passed=not failed and not undecided, reasons=failed, checks=checks, undecided=undecided)

    @property
    def status(self) -> str:
        return "passed" if self.passed else "rejected" if self.reasons else "undecided"

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready dict (tuples become lists)."""
        return {
            "status": self.status,
            "passed": self.passed,
            "reasons": list(self.reasons),
            "undecided": list(self.undecided),
            "checks": [asdict(c) for c in self.checks],
        }

    def to_markdown(self) -> str:
        """A verdict line, a table of every check, then the reasons and open calls (if any)."""
        verdict = {"passed": "passed ✅", "rejected": "rejected ❌", "undecided": "undecided ⚖️"}[self.status]
        lines = [
            f"**Gate: {verdict}**",
            "",
            "| check | observed | interval | threshold | result |",
            "|---|---|---|---|---|",
        ]
        for c in self.checks:
            if c.skipped:
                lines.append(f"| {c.name} | – | – | – | skipped ({c.skipped}) |")
            else:
                mark = "undecided" if c.undecided else "✅" if c.passed else "❌"
                interval = "–" if c.low is None else f"[{fmt(c.low)}, {fmt(c.high)}]"
                lines.append(f"| {c.name} | {fmt(c.observed)} | {interval} | {c.op} {fmt(c.threshold)} | {mark} |")
        if self.reasons or self.undecided:
            lines += ["", *(f"- {r}" for r in self.reasons), *(f"- undecided: {u}" for u in self.undecided)]
        return "\n".join(lines)


def fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.4g}"


def ci(i: Interval) -> str:
    return f"{fmt(i.estimate)} [{fmt(i.low)}, {fmt(i.high)}] ({i.level:.0%}, {i.n} prompts)"


def open_call(what: str, interval: Interval, bar: float, fail_below: float) -> str:
    """Why a call is open, and how many prompts would close it if the estimate held: on the
    side of the bar or of the rejection line where the estimate lies. An estimate between the
    two (within the margin) is decided by no number of prompts."""
    if interval.estimate > bar:
        needed = prompts_to_decide(interval, bar)
    elif interval.estimate < fail_below:
        needed = prompts_to_decide(interval, fail_below)
    else:
        needed = None
    if needed is None:
        more = ("no number of prompts decides it: the estimate is on the bar" if fail_below == bar else
                f"no number of prompts decides it: the estimate lies between {fmt(fail_below)} and the bar, "
                "as good as the bar within the margin")
    else:
        more = f"about {needed} prompts would decide it if the estimate held"
    below = "" if fail_below == bar else f" nor clearly below {fmt(fail_below)}"
    return f"{what} {ci(interval)} is neither clearly above {fmt(bar)}{below or ' nor clearly below it'}; {more}"


def better_than(name: str, code: str, interval: Interval, bar: float, fail_below: float, what: str,
                basis: str = "") -> Check:
    """Passes when the interval lies above `bar`; fails when it lies below `fail_below`
    (`bar` less a margin, or `bar` itself); else undecided."""
    base = dict(name=name, observed=interval.estimate, threshold=bar, op=">=", low=interval.low, high=interval.high)
    if interval.low > bar + TOLERANCE:
        return Check(passed=True, **base)
    if interval.high < fail_below - TOLERANCE:
        return Check(passed=False, reason=f"{code}: {what} {ci(interval)} < {basis}{fmt(fail_below)}", **base)
    return Check(passed=False, undecided=f"{name}: {open_call(what, interval, bar, fail_below)}", **base)


def not_worse_than(name: str, code: str, interval: Interval, bar: float, what: str, basis: str = "") -> Check:
    """Non-inferiority: passes when the interval's low end is at least `bar`, fails when its
    high end is below it, else undecided."""
    base = dict(name=name, observed=interval.estimate, threshold=bar, op=">=", low=interval.low, high=interval.high)
    if interval.low >= bar - TOLERANCE:
        return Check(passed=True, **base)
    if interval.high < bar - TOLERANCE:
        return Check(passed=False, reason=f"{code}: {what} {ci(interval)} < {basis}{fmt(bar)}", **base)
    return Check(passed=False, undecided=f"{name}: {open_call(what, interval, bar, bar)}", **base)


def not_above(name: str, code: str, interval: Interval, bar: float, what: str) -> Check:
    """Passes when the interval's high end is at most `bar`, fails when its low end is above it,
    else undecided."""
    base = dict(name=name, observed=interval.estimate, threshold=bar, op="<=", low=interval.low, high=interval.high)
    if interval.high <= bar + TOLERANCE:
        return Check(passed=True, **base)
    if interval.low > bar + TOLERANCE:
        return Check(passed=False, reason=f"{code}: {what} {ci(interval)} > max {fmt(bar)}", **base)
    return Check(passed=False, undecided=f"{name}: {open_call(what, interval, bar, bar)}", **base)


def at_least(name: str, code: str, observed: float, threshold: float, what: str, basis: str = "") -> Check:
    """`basis` says where a derived threshold comes from, e.g. `reference 0.6 + min gain 0.05 = `."""
    passed = observed >= threshold - TOLERANCE
    reason = None if passed else f"{code}: {what} {fmt(observed)} < {basis}{fmt(threshold)}"
    return Check(name, passed, observed, threshold, ">=", reason=reason)


def at_most(name: str, code: str, observed: float, threshold: float, what: str) -> Check:
    passed = observed <= threshold + TOLERANCE
    reason = None if passed else f"{code}: {what} {fmt(observed)} > max {fmt(threshold)}"
    return Check(name, passed, observed, threshold, "<=", reason=reason)


def skip(name: str, op: Literal[">=", "<="], why: str) -> Check:
    return Check(name, True, None, None, op, skipped=why)
