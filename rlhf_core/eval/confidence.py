"""Paired bootstrap intervals for the gates: how sure a comparison on N held-out prompts is.

Two policies answer the same prompts, so their comparison is paired: per prompt there is one
outcome (`win_outcomes`: 1 the candidate's answer scored higher, 0.5 a tie, 0 lower;
`differences`: candidate correct minus baseline correct, in {-1, 0, 1}; `proxy_audit_gaps`:
the win outcome under the proxy reward model minus the one under the audit model), and the
figure the gates judge is the mean of those outcomes. The interval resamples prompts with replacement
(Efron's percentile bootstrap over the paired outcomes, Efron & Tibshirani 1993, ch. 13) and
takes the central `level` share of the resampled means. Resampling pairs keeps their
correlation: two policies that agree on most prompts get a narrow interval on their
difference even when each one's accuracy is uncertain. Intervals drawn with one seed over the
same N prompts use the same resamples.

Regression suites compare per-row correctness, where a candidate is typically wrong on a few
rows the reference gets right: there the percentile bootstrap of such rare outcomes covers far
less than its level (a suite of 100 rows on which the candidate loses 1 of the 5 rows it would
lose at the margin resamples as if it never lost more). Their difference takes
`paired_score_interval`, Newcombe's hybrid score interval for a difference of paired
proportions (Newcombe 1998, Stat. Med. 17: 2635-2650, method 10): Wilson score intervals of
each policy's accuracy, combined with the correlation of the paired outcomes.

`prompts_to_decide` says how many prompts would make an undecided call decided, if the
estimate stayed where it is: the interval's half-width shrinks as 1/sqrt(N).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np


@dataclass(frozen=True)
class Interval:
    """A mean over paired prompts and its bootstrap interval at `level`."""

    estimate: float
    low: float
    high: float
    level: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def to_dict(self) -> dict[str, float]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "level": self.level, "n": self.n}


def win_outcomes(candidate_scores: Sequence[float], baseline_scores: Sequence[float]) -> np.ndarray:
    """(N,) per prompt: 1 where the candidate scores higher, 0.5 on a tie, 0 lower. Their mean
    is `metrics.win_rate`."""
    c, b = np.asarray(candidate_scores, dtype=np.float64), np.asarray(baseline_scores, dtype=np.float64)
    if c.shape != b.shape:
        raise ValueError(f"{c.size} candidate scores for {b.size} baseline scores")
    return (c > b) + 0.5 * (c == b)


def differences(candidate_correct: Sequence[bool], baseline_correct: Sequence[bool]) -> np.ndarray:
    """(N,) per prompt: candidate correct minus baseline correct. Their mean is the accuracy gain."""
    c, b = np.asarray(candidate_correct, dtype=np.float64), np.asarray(baseline_correct, dtype=np.float64)
    if c.shape != b.shape:
        raise ValueError(f"{c.size} candidate outcomes for {b.size} baseline outcomes")
    return c - b


def proxy_audit_gaps(proxy_wins: Sequence[float], audit_wins: Sequence[float]) -> np.ndarray:
    """(N,) per prompt: the candidate's win outcome against the reference under the proxy reward
    model minus the one under the audit model, in {-1, -0.5, 0, 0.5, 1}. Their mean is the proxy
    win rate minus the audit's; resampling it resamples each prompt's two outcomes together."""
    p, a = np.asarray(proxy_wins, dtype=np.float64), np.asarray(audit_wins, dtype=np.float64)
    if p.shape != a.shape:
        raise ValueError(f"{p.size} proxy outcomes for {a.size} audit outcomes")
    return p - a


def bootstrap_interval(outcomes: Sequence[float], level: float, samples: int, seed: int = 0) -> Interval:
    """The percentile bootstrap interval of the mean of paired `outcomes` (N,): `samples`
    resamples of N prompts with replacement, drawn from a generator seeded with `seed`."""
    x = np.asarray(outcomes, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError("outcomes must be a non-empty 1-D sequence")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    means = np.empty(samples)
    for start in range(0, samples, 256):  # (256, N) index blocks: bounded memory for large N
        idx = rng.integers(0, x.size, size=(min(256, samples - start), x.size))
        means[start:start + idx.shape[0]] = x[idx].mean(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return Interval(float(x.mean()), float(low), float(high), level, int(x.size))


def wilson(successes: float, n: int, z: float) -> tuple[float, float]:
    """Wilson's score interval (low, high) of a proportion `successes / n` at normal quantile `z`."""
    p = successes / n
    centre, spread = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - spread) / (1 + z * z / n), (centre + spread) / (1 + z * z / n)


def paired_score_interval(candidate_correct: Sequence[bool], baseline_correct: Sequence[bool],
                          level: float) -> Interval:
    """Newcombe's hybrid score interval of candidate accuracy minus baseline accuracy on the
    same N rows (method 10): with each accuracy's Wilson interval (l, u) and the phi
    coefficient of the paired outcomes (its numerator ad - bc less N/2 when above it, 0 between
    0 and N/2, as Newcombe corrects it; 0 when a margin of the 2x2 table is empty),

        low  = d - sqrt((p1 - l1)^2 - 2 phi (p1 - l1)(u2 - p2) + (u2 - p2)^2)
        high = d + sqrt((u1 - p1)^2 - 2 phi (u1 - p1)(p2 - l2) + (p2 - l2)^2)."""
    c, b = np.asarray(candidate_correct, dtype=bool), np.asarray(baseline_correct, dtype=bool)
    if c.shape != b.shape or c.ndim != 1 or c.size == 0:
        raise ValueError(f"{c.size} candidate outcomes for {b.size} baseline outcomes (need the same, at least 1)")
    n = c.size
    both, only_c, only_b = int(np.sum(c & b)), int(np.sum(c & ~b)), int(np.sum(~c & b))
    neither = n - both - only_c - only_b
    p1, p2 = (both + only_c) / n, (both + only_b) / n
    z = NormalDist().inv_cdf(1 - (1 - level) / 2)
    (l1, u1), (l2, u2) = wilson(both + only_c, n, z), wilson(both + only_b, n, z)
    margins = (both + only_c) * (only_b + neither) * (both + only_b) * (only_c + neither)
    covariance = both * neither - only_c * only_b
    covariance = covariance - n / 2 if covariance > n / 2 else min(covariance, 0)  # Newcombe's correction
    phi = covariance / math.sqrt(margins) if margins else 0.0
    d = p1 - p2
    low = d - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    high = d + math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return Interval(d, max(-1.0, low), min(1.0, high), level, n)


def prompts_to_decide(interval: Interval, bar: float) -> int | None:
    """Prompts at which the interval would clear `bar` on the side its estimate is on, if the
    estimate stayed: N * (half-width / |estimate - bar|)^2. None when the estimate is on the
    bar (no number of prompts decides it)."""
    gap = abs(interval.estimate - bar)
    if gap == 0:
        return None
    return max(interval.n + 1, math.ceil(interval.n * (interval.half_width / gap) ** 2))
