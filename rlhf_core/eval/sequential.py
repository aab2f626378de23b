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

`look_sizes` and `look_levels` are the plan, `run_looks` makes the looks, and `Look` is one
look's record for the gate report. `rows_to_decide` and `decidable_gap` are the power
calculation `rlhf check-config` warns with.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

from rlhf_core.eval.checks import not_worse_than
from rlhf_core.eval.confidence import Interval


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


def run_looks(first: int, available: int, budget: int, margin: float, confidence: float,
              answer_to: Callable[[int], None], intervals: Callable[[float], tuple[Interval, Interval | None]],
              ) -> tuple[Look, ...]:
    """Look at a suite until its calls are decided: `answer_to(n)` has every policy answer the
    suite's first n rows, `intervals(level)` gives the candidate's paired intervals of the
    difference (vs the reference, and vs the champion or None) on the rows answered so far.
    The looks are planned over `min(available, budget)` rows (`available`: the suite's rows);
    they stop at the first look whose calls are all decided at `-margin` (non-inferiority,
    `checks.not_worse_than`), or at the last planned one, saying which."""
    sizes = look_sizes(min(first, available, budget), min(available, budget))
    looks = []
    for n, level in zip(sizes, look_levels(sizes, confidence)):
        answer_to(n)
        vs_reference, vs_champion = intervals(level)
        calls = [i for i in (vs_reference, vs_champion) if i is not None]
        stopped = None
        if all(not_worse_than("", "", i, -margin, "").undecided is None for i in calls):
            stopped = "decided"
        elif n == sizes[-1]:
            stopped = f"budget of {n} rows reached" if n == budget else f"the suite has no more rows ({n})"
        looks.append(Look(n, level, vs_reference.to_dict(), None if vs_champion is None else vs_champion.to_dict(),
                          stopped))
        if stopped:
            break
    return tuple(looks)


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
