"""Looks at a comparison whose suite can give more rows: a group-sequential design.

A regression suite that is undecided after its first rows (its interval straddles the margin)
is answered on more rows, in looks that double the rows until the suite's budget
(`rows`, `2 rows`, `4 rows`, ..., `max_rows`), and the call is made again at each look. Looking
more than once at a fixed 95% interval would let a candidate pass on a lucky look far more than
5% of the time; instead the error rate `alpha = 1 - confidence` is spent across the planned
looks with the Lan-DeMets spending function of Pocock's type,

    alpha(t) = alpha * ln(1 + (e - 1) t),    t = rows at the look / max_rows,

and look k's interval has the two-sided level `1 - (alpha(t_k) - alpha(t_{k-1}))`. By the union
bound, the chance that any look's interval misses the true difference is at most `alpha`, so
the whole procedure errs on either side (a false pass, or a false rejection) at most `alpha/2`
of the time, as one fixed interval at `confidence` does (Lan & DeMets 1983, Biometrika 70:
659-663; Jennison & Turnbull 2000, "Group Sequential Methods", ch. 7). The union bound makes
it conservative: the intervals of successive looks share rows. A suite that cannot give more
rows (a file used whole, `max_rows` = `rows`) has one look at `confidence`, as before.

`look_sizes` and `look_levels` are the plan, and `Look` is one look's record for the gate
report (`rlhf_core.eval.regression.run_looks` makes the looks). The eval prompts are looked at
alike (`rlhf_core.eval.evaluate.evaluate`, each look an `EvalLook`), on the gate's calls about
them (`EVAL_SET_CALLS`). `rows_to_decide` and
`decidable_gap` are the power calculation `power_warnings` (`rlhf check-config`) warns with.
Plain arithmetic on the config: the command line imports this module without torch or numpy.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

from rlhf_core.config import RegressionSuiteConfig

DEMO_PREFIX = "demo:"  # a suite the demo generates (`rlhf_core.eval.regression`)
DEMO_FIRST_ROWS = 200  # a demo suite's first look without `rows`


def look_sizes(first: int, budget: int) -> tuple[int, ...]:
    """Cumulative rows at each look: `first`, doubled at each look, the last one `budget`."""
    if first < 1 or budget < first:
        raise ValueError(f"looks need 1 <= first rows <= budget, got {first} and {budget}")
    sizes = [first]
    while sizes[-1] < budget:
        sizes.append(min(2 * sizes[-1], budget))
    return tuple(sizes)


def spent(alpha: float, t: float) -> float:
    """Error rate spent by information fraction `t` in (0, 1]: Pocock-type Lan-DeMets spending."""
    return alpha * math.log(1 + (math.e - 1) * t)


def look_levels(sizes: tuple[int, ...], confidence: float) -> tuple[float, ...]:
    """Two-sided interval level of each look of `sizes` (the last the budget): the share of
    `1 - confidence` spent between the look before and this one, taken from 1."""
    alpha, budget = 1 - confidence, sizes[-1]
    fractions = [0.0, *(n / budget for n in sizes)]
    return tuple(1 - (spent(alpha, fractions[k + 1]) - spent(alpha, fractions[k])) for k in range(len(sizes)))


@dataclass(frozen=True)
class Look:
    """One look at a suite: its rows, the level its intervals were drawn at, the paired
    intervals of the difference (vs the reference, and vs the champion when there is one; as
    `Interval.to_dict`), and why the looks stopped here (None: they went on)."""

    rows: int
    level: float
    vs_reference: dict
    vs_champion: dict | None
    stopped: str | None = None


EVAL_SET_CALLS = ("accuracy_vs_reference", "accuracy_vs_champion", "win_rate_vs_reference", "win_rate_vs_champion",
                  "audit_vs_reference", "proxy_audit_gap")  # the gate's checks that more eval prompts can decide


@dataclass(frozen=True)
class EvalLook:
    """One look at the eval prompts: its prompts, the level of its intervals, each eval-set
    call's estimate and interval (`EVAL_SET_CALLS`, as the gate judged them), the calls still
    open, and why the looks stopped here (None: they went on)."""

    rows: int
    level: float
    calls: dict[str, dict]
    open: tuple[str, ...]
    stopped: str | None = None


def eval_look(decision, n: int, level: float, last: bool, budget: int) -> EvalLook:
    """The record of a look at `n` eval prompts that the judge gave `decision` (`rlhf_core.eval.checks.Decision`); it stops the
    looks when no eval-set call is open, when a check rejects, or when it is the `last`."""
    calls = {c.name: {"estimate": c.observed, "low": c.low, "high": c.high}
             for c in decision.checks if c.name in EVAL_SET_CALLS and c.low is not None}
    still_open = tuple(c.name for c in decision.checks if c.undecided and c.name in EVAL_SET_CALLS)
    stopped = None
    if decision.reasons:
        stopped = "rejected: more prompts cannot change the verdict"
    elif not still_open:
        stopped = "decided"
    elif last:
        stopped = f"budget of {n} prompts reached" if n == budget else f"the eval set has no more prompts ({n})"
    return EvalLook(n, level, calls, still_open, stopped)


def _z(level: float) -> float:
    return NormalDist().inv_cdf(1 - (1 - level) / 2)


def rows_to_decide(margin: float, level: float) -> int:
    """Rows a non-inferiority call at `-margin` needs to be decided on average for a candidate
    that lost half the margin (wrong on a `margin/2` share of rows the reference gets right):
    the interval's half-width `z sqrt(p (1 - p) / n)`, p = margin/2, must shrink below margin/2."""
    p = margin / 2
    return math.ceil((_z(level) * math.sqrt(p * (1 - p)) / p) ** 2)


def decidable_gap(rows: int, margin: float, level: float) -> float:
    """The smallest distance from `-margin` at which `rows` rows decide such a call on average:
    the interval's half-width there."""
    p = margin / 2
    return _z(level) * math.sqrt(p * (1 - p) / rows)


def power_warnings(suites: Sequence[RegressionSuiteConfig], confidence: float | None) -> list[str]:
    """One line per suite too small for its margin: whose budget of rows (a file's rows, or
    `max_rows`) leaves a candidate that lost half the margin undecided on average, at the level
    of the suite's last look (`rows_to_decide`). A file that cannot be read is left to the
    run's own check (`rlhf_core.eval.regression.load_suites`), which names what is wrong."""
    if confidence is None:
        return []
    warnings = []
    for suite in suites:
        available = math.inf  # a demo suite's rows: as many as asked
        if not suite.path.startswith(DEMO_PREFIX):
            try:
                available = sum(1 for line in Path(suite.path).read_bytes().splitlines() if line.strip())
            except OSError:
                continue
        first = min(suite.rows or (DEMO_FIRST_ROWS if available == math.inf else available), available)
        if first < 1:
            continue
        budget = max(first, min(suite.max_rows or first, available))
        level = look_levels(look_sizes(first, budget), confidence)[-1]
        needed = rows_to_decide(suite.margin, level)
        if budget < needed:
            warnings.append(
                f"regression suite {suite.name} (gates.regression_suites): {budget} rows tell an accuracy "
                f"difference from the margin -{suite.margin:g} only {decidable_gap(budget, suite.margin, level):.3f} "
                f"or more away from it ({level:.1%}): a candidate that lost {suite.margin / 2:g} of them would stay "
                f"undecided; about {needed} rows would decide it: add rows to {suite.path}, or raise its margin")
    return warnings
