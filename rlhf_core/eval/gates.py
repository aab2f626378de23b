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
                            <= max_proxy_audit_gap (off unless set)
    kl_to_reference         KL to the reference <= max_kl
    length_ratio            mean length / reference mean length <= max_length_ratio
    degenerate_rate         degenerate share <= max_degenerate_rate
    generation_failures     failed-prompt share <= max_generation_failure_rate

Accuracy checks are skipped when the task has no answers (`accuracy is None`); champion
checks are skipped when there is no champion yet; the audit check when there is no audit model. A value equal to its threshold passes
(up to `TOLERANCE`, so `0.8 - 0.1` does not reject an accuracy of exactly 0.7). A NaN
figure fails its check rather than raising, so a broken evaluation is rejected with a reason.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from rlhf_core.config import GateConfig

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
    """

    name: str
    passed: bool
    observed: float | None
    threshold: float | None
    op: Literal[">=", "<="]
    skipped: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Decision:
    """The gate's verdict: `passed` iff no check failed; one `reasons` line per failed check."""

    passed: bool
    reasons: tuple[str, ...]
    checks: tuple[Check, ...]

    @classmethod
    def from_checks(cls, checks: tuple[Check, ...]) -> "Decision":
        failed = tuple(c.reason for c in checks if not c.passed)
        return cls(passed=not failed, reasons=failed, checks=checks)

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready dict (tuples become lists)."""
        return {
            "passed": self.passed,
            "reasons": list(self.reasons),
            "checks": [asdict(c) for c in self.checks],
        }

    def to_markdown(self) -> str:
        """A verdict line, a table of every check, then the reasons (if any)."""
        lines = [
            f"**Gate: {'passed ✅' if self.passed else 'rejected ❌'}**",
            "",
            "| check | observed | threshold | result |",
            "|---|---|---|---|",
        ]
        for c in self.checks:
            if c.skipped:
                lines.append(f"| {c.name} | – | – | skipped ({c.skipped}) |")
            else:
                mark = "✅" if c.passed else "❌"
                lines.append(f"| {c.name} | {_fmt(c.observed)} | {c.op} {_fmt(c.threshold)} | {mark} |")
        if self.reasons:
            lines += ["", *(f"- {r}" for r in self.reasons)]
        return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.4g}"


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
        else:
            acc_champ = _at_least(
                "accuracy_vs_champion", "accuracy_regressed_vs_champion", candidate.accuracy,
                champion.accuracy - t.max_regression_vs_champion, "accuracy",
                f"champion {_fmt(champion.accuracy)} - max regression {_fmt(t.max_regression_vs_champion)} = ",
            )
        win_champ = _at_least(
            "win_rate_vs_champion", "win_rate_vs_champion_too_low", candidate.win_rate_vs_champion,
            t.min_win_rate_vs_champion, "win rate vs champion", "min ",
        )

    if candidate.audit_win_rate_vs_reference is None:
        audit = _skipped("audit_vs_reference", ">=", "no audit model")
    else:
        audit = _at_least(
            "audit_vs_reference", "audit_rejects_candidate", candidate.audit_win_rate_vs_reference,
            t.min_audit_win_rate_vs_reference,
            f"win rate vs reference under the audit reward model (the proxy's: "
            f"{_fmt(candidate.win_rate_vs_reference)})", "min ",
        )

    if candidate.audit_win_rate_vs_reference is None or t.max_proxy_audit_gap is None:
        gap = _skipped("proxy_audit_gap", "<=", "no audit model" if candidate.audit_win_rate_vs_reference is None
                       else "gates.max_proxy_audit_gap not set")
    else:
        gap = _at_most(
            "proxy_audit_gap", "wins_on_proxy_only",
            candidate.win_rate_vs_reference - candidate.audit_win_rate_vs_reference, t.max_proxy_audit_gap,
            f"win rate vs reference {_fmt(candidate.win_rate_vs_reference)} under the proxy but "
            f"{_fmt(candidate.audit_win_rate_vs_reference)} under the audit: gap",
        )

    checks = (
        acc_ref,
        acc_champ,
        _at_least(
            "win_rate_vs_reference", "win_rate_vs_reference_too_low", candidate.win_rate_vs_reference,
            t.min_win_rate_vs_reference, "win rate vs reference", "min ",
        ),
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
