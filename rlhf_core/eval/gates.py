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
    regression_vs_reference:<suite>, regression_vs_champion:<suite>
                            for each of `regression_suites`: accuracy on the suite minus the
                            reference's (the champion's) >= -margin of the suite; a candidate
                            that lost a skill the base model had is rejected as `regression:<suite>`

With confidence intervals (`gates.confidence`; `rlhf_core.eval.confidence`, paired bootstrap
over the prompts) the four comparisons with the reference and the champion, the two audit
checks and the regression suites decide on the interval, not the point estimate, and a call
may be *undecided*:

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
    not worse on a suite        regression suites, against the reference and the champion: the
                                same rule with the suite's margin, on Newcombe's paired score
                                interval over the rows of the suite's last look
                                (`rlhf_core.eval.sequential`)
    better than the champion    win rate: passes when the low end is above
                                min_win_rate_vs_champion, fails when the high end is below it
                                by more than win_rate_margin_vs_champion

A candidate as good as the champion is then neither promoted nor rejected: the decision is
`undecided`, and says how many prompts would decide each open call. Without intervals (None
in the figures) the checks compare point estimates.

Accuracy checks are skipped when the task has no answers (`accuracy is None`); champion
checks (a suite's too) are skipped when there is no champion yet; the audit checks when there
is no audit model. A value equal to its threshold passes (up to `TOLERANCE`, so `0.8 - 0.1` does not
reject an accuracy of exactly 0.7), as does a gap interval whose high end equals the maximum.
A NaN figure fails its check rather than raising, so a broken evaluation is rejected with a
reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rlhf_core.config import GateConfig
from rlhf_core.eval.checks import (  # noqa: F401 - Check, Decision and TOLERANCE are re-exported
    TOLERANCE, Check, Decision, at_least, at_most, better_than, fmt, not_above, not_worse_than, skip,
)
from rlhf_core.eval.confidence import Interval
from rlhf_core.eval.sequential import Look

_better_than = better_than  # the name the interval tests import it by

_SHARES = ("win_rate_vs_reference", "win_rate_vs_champion", "degenerate_rate", "generation_failures", "accuracy",
           "audit_win_rate_vs_reference")


@dataclass(frozen=True)
class SuiteFigures:
    """One policy's accuracy on one regression suite (`gates.regression_suites`): the share of
    its greedy answers the suite's checker accepts. `diff_vs_reference` / `diff_vs_champion`
    are the paired score intervals of its accuracy minus the reference's / the champion's on the
    same rows (`confidence.paired_score_interval`), at the last look's level; None without
    `gates.confidence` (and without a champion, for the latter): the gate then compares the
    accuracies. A suite that can give more rows is answered in looks (`rlhf_core.eval.sequential`)."""

    name: str
    accuracy: float
    diff_vs_reference: Interval | None = None
    diff_vs_champion: Interval | None = None
    looks: tuple[Look, ...] = ()  # the candidate's: each look's rows, level, intervals and why it stopped

    def __post_init__(self) -> None:
        if self.accuracy < 0 or self.accuracy > 1:  # NaN passes, to fail its check
            raise ValueError(f"regression suite {self.name}: accuracy is a share in [0, 1], got {self.accuracy}")


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
    regression: the policy's figures on each of `gates.regression_suites`, in their order.
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
    regression: tuple[SuiteFigures, ...] = ()

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


def _require_consistent(candidate: EvalFigures, reference: EvalFigures, champion: EvalFigures | None,
                        thresholds: GateConfig) -> None:
    """Figures that cannot describe one evaluation are a caller's bug, not a rejection."""
    if (candidate.accuracy is None) != (reference.accuracy is None):
        raise ValueError("candidate and reference must both have an accuracy or neither (same eval prompts)")
    if champion is not None and (candidate.accuracy is None) != (champion.accuracy is None):
        raise ValueError("candidate and champion must both have an accuracy or neither (same eval prompts)")
    if (champion is None) != (candidate.win_rate_vs_champion is None):
        raise ValueError("candidate.win_rate_vs_champion must be given exactly when there is a champion")
    suites = [s.name for s in thresholds.regression_suites]
    for who, figures in (("candidate", candidate), ("reference", reference), ("champion", champion)):
        if figures is not None and [s.name for s in figures.regression] != suites:
            raise ValueError(f"the {who}'s regression figures {[s.name for s in figures.regression]} are not "
                             f"those of gates.regression_suites {suites}")


def gate(
    candidate: EvalFigures, reference: EvalFigures, champion: EvalFigures | None, thresholds: GateConfig
) -> Decision:
    """Check a candidate against the reference policy, the champion (if any) and the thresholds.

    `reference` is the policy RL started from (the SFT model); `champion` is the currently
    promoted policy, None before the first promotion. The length ratio is the candidate's
    own `mean_length / reference_mean_length`, both measured on the same prompts. Each policy's
    `regression` figures are those of `thresholds.regression_suites`, in that order.
    """
    _require_consistent(candidate, reference, champion, thresholds)
    t = thresholds
    accuracy_vs_champion, win_rate_vs_champion = _champion_checks(candidate, champion, t)
    checks = (
        _accuracy_vs_reference(candidate, reference, t),
        accuracy_vs_champion,
        _win_rate_vs_reference(candidate, t),
        win_rate_vs_champion,
        *_audit_checks(candidate, t),
        at_most("kl_to_reference", "kl_above_max", candidate.kl_to_reference, t.max_kl, "KL to reference"),
        at_most(
            "length_ratio", "length_ratio_above_max", candidate.length_ratio, t.max_length_ratio,
            "mean length / reference mean length",
        ),
        at_most(
            "degenerate_rate", "degenerate_rate_above_max", candidate.degenerate_rate, t.max_degenerate_rate,
            "degenerate share",
        ),
        at_most(
            "generation_failures", "generation_failures_above_max", candidate.generation_failures,
            t.max_generation_failure_rate, "failed-prompt share",
        ),
        *_regression_checks(candidate, reference, champion, t),
    )
    return Decision.from_checks(checks)


_NO_ANSWERS, _NO_CHAMPION = "no answers", "no champion"


def _accuracy_vs_reference(candidate: EvalFigures, reference: EvalFigures, t: GateConfig) -> Check:
    if candidate.accuracy is None:
        return skip("accuracy_vs_reference", ">=", _NO_ANSWERS)
    if (gain := candidate.accuracy_gain_vs_reference) is not None:
        return better_than("accuracy_vs_reference", "accuracy_below_reference", gain, t.min_accuracy_gain,
                           t.min_accuracy_gain, "accuracy gain over the reference", "min gain ")
    return at_least(
        "accuracy_vs_reference", "accuracy_below_reference", candidate.accuracy,
        reference.accuracy + t.min_accuracy_gain, "accuracy",
        f"reference {fmt(reference.accuracy)} + min gain {fmt(t.min_accuracy_gain)} = ",
    )


def _champion_checks(candidate: EvalFigures, champion: EvalFigures | None, t: GateConfig) -> tuple[Check, Check]:
    """(accuracy_vs_champion, win_rate_vs_champion)."""
    if champion is None:
        return skip("accuracy_vs_champion", ">=", _NO_CHAMPION), skip("win_rate_vs_champion", ">=", _NO_CHAMPION)
    if candidate.accuracy is None:
        accuracy = skip("accuracy_vs_champion", ">=", _NO_ANSWERS)
    elif (diff := candidate.accuracy_gain_vs_champion) is not None:
        accuracy = not_worse_than("accuracy_vs_champion", "accuracy_regressed_vs_champion", diff,
                                  -t.max_regression_vs_champion, "accuracy minus the champion's", "-max regression ")
    else:
        accuracy = at_least(
            "accuracy_vs_champion", "accuracy_regressed_vs_champion", candidate.accuracy,
            champion.accuracy - t.max_regression_vs_champion, "accuracy",
            f"champion {fmt(champion.accuracy)} - max regression {fmt(t.max_regression_vs_champion)} = ",
        )
    if (wins := candidate.win_rate_vs_champion_interval) is not None:
        win_rate = better_than(
            "win_rate_vs_champion", "win_rate_vs_champion_too_low", wins, t.min_win_rate_vs_champion,
            t.min_win_rate_vs_champion - t.win_rate_margin_vs_champion, "win rate vs champion",
            f"min {fmt(t.min_win_rate_vs_champion)} - margin {fmt(t.win_rate_margin_vs_champion)} = ")
    else:
        win_rate = at_least(
            "win_rate_vs_champion", "win_rate_vs_champion_too_low", candidate.win_rate_vs_champion,
            t.min_win_rate_vs_champion, "win rate vs champion", "min ",
        )
    return accuracy, win_rate


def _win_rate_vs_reference(candidate: EvalFigures, t: GateConfig) -> Check:
    if (wins := candidate.win_rate_vs_reference_interval) is not None:
        return better_than("win_rate_vs_reference", "win_rate_vs_reference_too_low", wins,
                           t.min_win_rate_vs_reference, t.min_win_rate_vs_reference, "win rate vs reference", "min ")
    return at_least(
        "win_rate_vs_reference", "win_rate_vs_reference_too_low", candidate.win_rate_vs_reference,
        t.min_win_rate_vs_reference, "win rate vs reference", "min ",
    )


def _audit_checks(candidate: EvalFigures, t: GateConfig) -> tuple[Check, Check]:
    """(audit_vs_reference, proxy_audit_gap)."""
    if candidate.audit_win_rate_vs_reference is None:
        return (skip("audit_vs_reference", ">=", "no audit model"),
                skip("proxy_audit_gap", "<=", "no audit model"))
    what = (f"win rate vs reference under the audit reward model (the proxy's: "
            f"{fmt(candidate.win_rate_vs_reference)})")
    if (audit_wins := candidate.audit_win_rate_vs_reference_interval) is not None:
        audit = better_than("audit_vs_reference", "audit_rejects_candidate", audit_wins,
                            t.min_audit_win_rate_vs_reference, t.min_audit_win_rate_vs_reference, what, "min ")
    else:
        audit = at_least("audit_vs_reference", "audit_rejects_candidate", candidate.audit_win_rate_vs_reference,
                         t.min_audit_win_rate_vs_reference, what, "min ")
    if t.max_proxy_audit_gap is None:
        return audit, skip("proxy_audit_gap", "<=", "gates.max_proxy_audit_gap not set")
    gap_what = (f"win rate vs reference {fmt(candidate.win_rate_vs_reference)} under the proxy but "
                f"{fmt(candidate.audit_win_rate_vs_reference)} under the audit: gap")
    if (gaps := candidate.proxy_audit_gap_interval) is not None:
        return audit, not_above("proxy_audit_gap", "wins_on_proxy_only", gaps, t.max_proxy_audit_gap, gap_what)
    return audit, at_most("proxy_audit_gap", "wins_on_proxy_only",
                          candidate.win_rate_vs_reference - candidate.audit_win_rate_vs_reference,
                          t.max_proxy_audit_gap, gap_what)


def _regression_checks(candidate: EvalFigures, reference: EvalFigures, champion: EvalFigures | None,
                       t: GateConfig) -> list[Check]:
    """Per suite of `t.regression_suites`: not worse than the reference, and than the champion."""
    checks = []
    for i, suite in enumerate(t.regression_suites):
        mine = candidate.regression[i]
        checks.append(no_regression(mine, reference.regression[i], mine.diff_vs_reference, "reference",
                                     suite.margin))
        if champion is None:
            checks.append(skip(f"regression_vs_champion:{suite.name}", ">=", _NO_CHAMPION))
        else:
            checks.append(no_regression(mine, champion.regression[i], mine.diff_vs_champion, "champion",
                                         suite.margin))
    return checks


def no_regression(suite: SuiteFigures, baseline: SuiteFigures, diff: Interval | None, vs: str,
                   margin: float) -> Check:
    """Non-inferiority on one suite, as `accuracy_vs_champion`: the accuracy difference (its
    interval's low end, with intervals) must be at least -margin; rejected as `regression:<suite>`."""
    name, code = f"regression_vs_{vs}:{suite.name}", f"regression:{suite.name}"
    what = f"suite {suite.name}: accuracy {fmt(suite.accuracy)} vs the {vs}'s {fmt(baseline.accuracy)}, difference"
    if diff is not None:
        return not_worse_than(name, code, diff, -margin, what, "-margin ")
    return at_least(name, code, suite.accuracy - baseline.accuracy, -margin, what, "-margin ")
