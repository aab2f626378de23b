"""Promotion gates: may a trained policy replace the champion?

`gate(candidate, reference, champion, thresholds)` is a pure function of evaluation figures
and returns a `Decision` that lists every check, passed, failed or skipped, so the rule can
be tested without a model and a rejection explains itself. The flow around it does the I/O:
evaluate, call `gate`, log the decision, and promote only when it passed.

The checks, in the order they are reported:

    accuracy_vs_reference   accuracy >= reference accuracy + min_accuracy_gain
    accuracy_vs_champion    accuracy >= champion accuracy - max_regression_vs_champion
    win_rate_vs_reference   win rate vs the reference >= min_win_rate_vs_reference
    win_rate_vs_champion    win rate vs the champion >= min_win_rate_vs_champion
    audit_vs_reference      win rate vs the reference under the audit reward model (one the
                            policy never trained against) >= min_audit_win_rate_vs_reference:
                            a candidate that wins only on the proxy it was trained on is hacking it
    proxy_audit_gap         win rate vs the reference under the proxy minus the audit's
                            <= max_proxy_audit_gap (null: off): a candidate the audit
                            prefers much less than the proxy does wins on the proxy only
    kl_to_reference         KL to the reference <= max_kl
    length_ratio            mean length / reference mean length <= max_length_ratio
    degenerate_rate         degenerate share <= max_degenerate_rate
    generation_failures     failed-prompt share <= max_generation_failure_rate

With confidence intervals (`gates.confidence`; `rlhf_core.eval.confidence`, paired bootstrap
over the prompts) the four comparisons with the reference and the champion and the two audit
checks decide on the interval, not the point estimate, and a call may be *undecided*:

    better than the reference   accuracy gain, win rate, and win rate under the audit model:
                                passes when the interval's low end is above the bar, fails
                                when its high end is below it, else undecided
    proxy-audit gap             the interval of the per-prompt difference of the two win
                                outcomes (the same resamples for both): fails
                                ("wins_on_proxy_only") when its low end is above
                                max_proxy_audit_gap, passes when its high end is at most that,
                                else undecided
    not worse than the champion accuracy: passes when the low end of the accuracy difference
                                is at least -max_regression_vs_champion (non-inferiority),
                                fails ("regressed") when its high end is below that
    better than the champion    win rate: passes when the low end is above
                                min_win_rate_vs_champion, fails when the high end is below it
                                by more than win_rate_margin_vs_champion

A candidate as good as the champion is then neither promoted nor rejected: the decision is
`undecided`, and says how many prompts would decide each open call. Without intervals (None
in the figures) the checks compare point estimates.

Accuracy checks are skipped when the task has no answers (`accuracy is None`); champion
checks are skipped when there is no champion yet; the audit checks when there is no audit
model. A value equal to its threshold passes (up to `TOLERANCE`, so `0.8 - 0.1` does not
reject an accuracy of exactly 0.7), as does a gap interval whose high end equals the maximum.
A NaN figure fails its check rather than raising, so a broken evaluation is rejected with a
reason.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from rlhf_core.config import GateConfig
from rlhf_core.eval.confidence import Interval, prompts_to_decide

TOLERANCE = 1e-9

_SHARES = ("win_rate_vs_reference", "win_rate_vs_champion", "degenerate_rate", "generation_failures", "accuracy",
           "audit_win_rate_vs_reference")


@dataclass(frozen=True)
class EvalFigures:
    """One policy's figures on the held-out prompts, the gate's only input about a model.

    accuracy: exact match on prompts with a verifiable answer; None when there are no answers.
    rm_score_mean: mean reward-model score of the responses (reported, not gated: its scale
        is the reward model's, and a rising score alone is what reward hacking looks like).
    win_rate_vs_reference / win_rate_vs_champion: `metrics.win_rate` of this policy's scores
        against the reference's / champion's on the same prompts; the latter None without one.
    kl_to_reference: mean per-sequence KL to the reference policy (the unit of `policy.kl_bound`).
    mean_length / reference_mean_length: mean response length of this policy and of the
        reference on the same prompts, in the same unit (characters or tokens).
    degenerate_rate: `metrics.degenerate_rate` of the responses.
    generation_failures: share of prompts for which generation failed (error or timeout).
    audit_score_mean / audit_win_rate_vs_reference: the same figures under the audit reward
        model, which the policy never trained against; None without one.
    The `*_interval` and `accuracy_gain_*` fields are the paired bootstrap intervals of these
    comparisons (`rlhf_core.eval.confidence`); None without `gates.confidence` (or without the
    audit model, for the audit's), and the gates then compare the point estimates.
    """

    accuracy: float | None
    rm_score_mean: float
    win_rate_vs_reference: float
    win_rate_vs_champion: float | None
    kl_to_reference: float
    mean_length: float
    reference_mean_length: float
    degenerate_rate: float
    generation_failures: float
    audit_score_mean: float | None = None
    audit_win_rate_vs_reference: float | None = None
    # paired bootstrap intervals (None: the gates use the point estimates)
    accuracy_gain_vs_reference: Interval | None = None  # of accuracy minus the reference's
    accuracy_gain_vs_champion: Interval | None = None  # of accuracy minus the champion's
    win_rate_vs_reference_interval: Interval | None = None
    win_rate_vs_champion_interval: Interval | None = None
    audit_win_rate_vs_reference_interval: Interval | None = None
    proxy_audit_gap_interval: Interval | None = None  # of win_rate_vs_reference - audit_win_rate_vs_reference

    def __post_init__(self) -> None:
        for name in _SHARES:
            value = getattr(self, name)
            if value is not None and (value < 0 or value > 1):  # NaN passes, to fail its check
                raise ValueError(f"{name} is a share in [0, 1], got {value}")
        for name in ("mean_length", "reference_mean_length"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def length_ratio(self) -> float:
        """mean_length / reference_mean_length; 1 when both are 0, inf when only the reference is."""
        if math.isnan(self.mean_length) or math.isnan(self.reference_mean_length):
            return math.nan
        if self.reference_mean_length > 0:
            return self.mean_length / self.reference_mean_length
        return 1.0 if self.mean_length == 0 else math.inf


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
                interval = "–" if c.low is None else f"[{_fmt(c.low)}, {_fmt(c.high)}]"
                lines.append(f"| {c.name} | {_fmt(c.observed)} | {interval} | {c.op} {_fmt(c.threshold)} | {mark} |")
        if self.reasons or self.undecided:
            lines += ["", *(f"- {r}" for r in self.reasons), *(f"- undecided: {u}" for u in self.undecided)]
        return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.4g}"


def _ci(i: Interval) -> str:
    return f"{_fmt(i.estimate)} [{_fmt(i.low)}, {_fmt(i.high)}] ({i.level:.0%}, {i.n} prompts)"


def _open_call(what: str, interval: Interval, bar: float, fail_below: float) -> str:
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
                f"no number of prompts decides it: the estimate lies between {_fmt(fail_below)} and the bar, "
                "as good as the bar within the margin")
    else:
        more = f"about {needed} prompts would decide it if the estimate held"
    below = "" if fail_below == bar else f" nor clearly below {_fmt(fail_below)}"
    return f"{what} {_ci(interval)} is neither clearly above {_fmt(bar)}{below or ' nor clearly below it'}; {more}"


def _better_than(name: str, code: str, interval: Interval, bar: float, fail_below: float, what: str,
                 basis: str = "") -> Check:
    """Passes when the interval lies above `bar`; fails when it lies below `fail_below`
    (`bar` less a margin, or `bar` itself); else undecided."""
    base = dict(name=name, observed=interval.estimate, threshold=bar, op=">=", low=interval.low, high=interval.high)
    if interval.low > bar + TOLERANCE:
        return Check(passed=True, **base)
    if interval.high < fail_below - TOLERANCE:
        return Check(passed=False, reason=f"{code}: {what} {_ci(interval)} < {basis}{_fmt(fail_below)}", **base)
    return Check(passed=False, undecided=f"{name}: {_open_call(what, interval, bar, fail_below)}", **base)


def _not_worse_than(name: str, code: str, interval: Interval, bar: float, what: str, basis: str = "") -> Check:
    """Non-inferiority: passes when the interval's low end is at least `bar`, fails when its
    high end is below it, else undecided."""
    base = dict(name=name, observed=interval.estimate, threshold=bar, op=">=", low=interval.low, high=interval.high)
    if interval.low >= bar - TOLERANCE:
        return Check(passed=True, **base)
    if interval.high < bar - TOLERANCE:
        return Check(passed=False, reason=f"{code}: {what} {_ci(interval)} < {basis}{_fmt(bar)}", **base)
    return Check(passed=False, undecided=f"{name}: {_open_call(what, interval, bar, bar)}", **base)


def _not_above(name: str, code: str, interval: Interval, bar: float, what: str) -> Check:
    """Passes when the interval's high end is at most `bar`, fails when its low end is above it,
    else undecided."""
    base = dict(name=name, observed=interval.estimate, threshold=bar, op="<=", low=interval.low, high=interval.high)
    if interval.high <= bar + TOLERANCE:
        return Check(passed=True, **base)
    if interval.low > bar + TOLERANCE:
        return Check(passed=False, reason=f"{code}: {what} {_ci(interval)} > max {_fmt(bar)}", **base)
    return Check(passed=False, undecided=f"{name}: {_open_call(what, interval, bar, bar)}", **base)


def _at_least(name: str, code: str, observed: float, threshold: float, what: str, basis: str = "") -> Check:
    """`basis` says where a derived threshold comes from, e.g. `reference 0.6 + min gain 0.05 = `."""
    passed = observed >= threshold - TOLERANCE
    reason = None if passed else f"{code}: {what} {_fmt(observed)} < {basis}{_fmt(threshold)}"
    return Check(name, passed, observed, threshold, ">=", reason=reason)


def _at_most(name: str, code: str, observed: float, threshold: float, what: str) -> Check:
    passed = observed <= threshold + TOLERANCE
    reason = None if passed else f"{code}: {what} {_fmt(observed)} > max {_fmt(threshold)}"
    return Check(name, passed, observed, threshold, "<=", reason=reason)


def _skipped(name: str, op: Literal[">=", "<="], why: str) -> Check:
    return Check(name, True, None, None, op, skipped=why)


def _require_consistent(candidate: EvalFigures, reference: EvalFigures, champion: EvalFigures | None) -> None:
    """Figures that cannot describe one evaluation are a caller's bug, not a rejection."""
    if (candidate.accuracy is None) != (reference.accuracy is None):
        raise ValueError("candidate and reference must both have an accuracy or neither (same eval prompts)")
    if champion is not None and (candidate.accuracy is None) != (champion.accuracy is None):
        raise ValueError("candidate and champion must both have an accuracy or neither (same eval prompts)")
    if (champion is None) != (candidate.win_rate_vs_champion is None):
        raise ValueError("candidate.win_rate_vs_champion must be given exactly when there is a champion")


def gate(
    candidate: EvalFigures, reference: EvalFigures, champion: EvalFigures | None, thresholds: GateConfig
) -> Decision:
    """Check a candidate against the reference policy, the champion (if any) and the thresholds.

    `reference` is the policy RL started from (the SFT model); `champion` is the currently
    promoted policy, None before the first promotion. The length ratio is the candidate's
    own `mean_length / reference_mean_length`, both measured on the same prompts.
    """
    _require_consistent(candidate, reference, champion)
    t = thresholds
    no_answers, no_champion = "no answers", "no champion"

    if candidate.accuracy is None:
        acc_ref = _skipped("accuracy_vs_reference", ">=", no_answers)
    elif (gain := candidate.accuracy_gain_vs_reference) is not None:
        acc_ref = _better_than("accuracy_vs_reference", "accuracy_below_reference", gain, t.min_accuracy_gain,
                               t.min_accuracy_gain, "accuracy gain over the reference", "min gain ")
    else:
        acc_ref = _at_least(
            "accuracy_vs_reference", "accuracy_below_reference", candidate.accuracy,
            reference.accuracy + t.min_accuracy_gain, "accuracy",
            f"reference {_fmt(reference.accuracy)} + min gain {_fmt(t.min_accuracy_gain)} = ",
        )
    if champion is None:
        acc_champ = _skipped("accuracy_vs_champion", ">=", no_champion)
        win_champ = _skipped("win_rate_vs_champion", ">=", no_champion)
    else:
        if candidate.accuracy is None:
            acc_champ = _skipped("accuracy_vs_champion", ">=", no_answers)
        elif (diff := candidate.accuracy_gain_vs_champion) is not None:
            acc_champ = _not_worse_than("accuracy_vs_champion", "accuracy_regressed_vs_champion", diff,
                                        -t.max_regression_vs_champion, "accuracy minus the champion's",
                                        "-max regression ")
        else:
            acc_champ = _at_least(
                "accuracy_vs_champion", "accuracy_regressed_vs_champion", candidate.accuracy,
                champion.accuracy - t.max_regression_vs_champion, "accuracy",
                f"champion {_fmt(champion.accuracy)} - max regression {_fmt(t.max_regression_vs_champion)} = ",
            )
        if (wins := candidate.win_rate_vs_champion_interval) is not None:
            win_champ = _better_than(
                "win_rate_vs_champion", "win_rate_vs_champion_too_low", wins, t.min_win_rate_vs_champion,
                t.min_win_rate_vs_champion - t.win_rate_margin_vs_champion, "win rate vs champion",
                f"min {_fmt(t.min_win_rate_vs_champion)} - margin {_fmt(t.win_rate_margin_vs_champion)} = ")
        else:
            win_champ = _at_least(
                "win_rate_vs_champion", "win_rate_vs_champion_too_low", candidate.win_rate_vs_champion,
                t.min_win_rate_vs_champion, "win rate vs champion", "min ",
            )

    audit_what = (f"win rate vs reference under the audit reward model (the proxy's: "
                  f"{_fmt(candidate.win_rate_vs_reference)})")
    if candidate.audit_win_rate_vs_reference is None:
        audit = _skipped("audit_vs_reference", ">=", "no audit model")
    elif (audit_wins := candidate.audit_win_rate_vs_reference_interval) is not None:
        audit = _better_than("audit_vs_reference", "audit_rejects_candidate", audit_wins,
                             t.min_audit_win_rate_vs_reference, t.min_audit_win_rate_vs_reference, audit_what, "min ")
    else:
        audit = _at_least("audit_vs_reference", "audit_rejects_candidate", candidate.audit_win_rate_vs_reference,
                          t.min_audit_win_rate_vs_reference, audit_what, "min ")

    if candidate.audit_win_rate_vs_reference is None or t.max_proxy_audit_gap is None:
        gap = _skipped("proxy_audit_gap", "<=", "no audit model" if candidate.audit_win_rate_vs_reference is None
                       else "gates.max_proxy_audit_gap not set")
    else:
        gap_what = (f"win rate vs reference {_fmt(candidate.win_rate_vs_reference)} under the proxy but "
                    f"{_fmt(candidate.audit_win_rate_vs_reference)} under the audit: gap")
        if (gaps := candidate.proxy_audit_gap_interval) is not None:
            gap = _not_above("proxy_audit_gap", "wins_on_proxy_only", gaps, t.max_proxy_audit_gap, gap_what)
        else:
            gap = _at_most("proxy_audit_gap", "wins_on_proxy_only",
                           candidate.win_rate_vs_reference - candidate.audit_win_rate_vs_reference,
                           t.max_proxy_audit_gap, gap_what)

    if (wins_ref := candidate.win_rate_vs_reference_interval) is not None:
        win_ref = _better_than("win_rate_vs_reference", "win_rate_vs_reference_too_low", wins_ref,
                               t.min_win_rate_vs_reference, t.min_win_rate_vs_reference, "win rate vs reference",
                               "min ")
    else:
        win_ref = _at_least(
            "win_rate_vs_reference", "win_rate_vs_reference_too_low", candidate.win_rate_vs_reference,
            t.min_win_rate_vs_reference, "win rate vs reference", "min ",
        )
    checks = (
        acc_ref,
        acc_champ,
        win_ref,
        win_champ,
        audit,
        gap,
        _at_most("kl_to_reference", "kl_above_max", candidate.kl_to_reference, t.max_kl, "KL to reference"),
        _at_most(
            "length_ratio", "length_ratio_above_max", candidate.length_ratio, t.max_length_ratio,
            "mean length / reference mean length",
        ),
        _at_most(
            "degenerate_rate", "degenerate_rate_above_max", candidate.degenerate_rate, t.max_degenerate_rate,
            "degenerate share",
        ),
        _at_most(
            "generation_failures", "generation_failures_above_max", candidate.generation_failures,
            t.max_generation_failure_rate, "failed-prompt share",
        ),
    )
    return Decision.from_checks(checks)
