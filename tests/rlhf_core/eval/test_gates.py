import json
import math
from dataclasses import replace

import pytest

from rlhf_core.config import ConfigError, GateConfig, parse_config
from rlhf_core.eval.confidence import Interval, bootstrap_interval, differences
from rlhf_core.eval.gates import Decision, EvalFigures, SuiteFigures, gate

CHECK_ORDER = [
    "accuracy_vs_reference",
    "accuracy_vs_champion",
    "win_rate_vs_reference",
    "win_rate_vs_champion",
    "audit_vs_reference",
    "proxy_audit_gap",
    "kl_to_reference",
    "length_ratio",
    "degenerate_rate",
    "generation_failures",
]

# Explicit, so the table does not move when the defaults do.
T = GateConfig(
    min_accuracy_gain=0.05,
    max_regression_vs_champion=0.02,
    min_win_rate_vs_reference=0.55,
    min_win_rate_vs_champion=0.5,
    max_kl=5.0,
    max_length_ratio=1.5,
    max_degenerate_rate=0.05,
    max_generation_failure_rate=0.01,
    max_proxy_audit_gap=0.1,
)
REFERENCE = EvalFigures(
    accuracy=0.40, rm_score_mean=0.0, win_rate_vs_reference=0.5, win_rate_vs_champion=None,
    kl_to_reference=0.0, mean_length=4.0, reference_mean_length=4.0, degenerate_rate=0.0, generation_failures=0.0,
)
CHAMPION = EvalFigures(
    accuracy=0.80, rm_score_mean=1.0, win_rate_vs_reference=0.7, win_rate_vs_champion=None,
    kl_to_reference=2.0, mean_length=4.2, reference_mean_length=4.0, degenerate_rate=0.0, generation_failures=0.0,
)
GOOD = EvalFigures(
    accuracy=0.85, rm_score_mean=1.2, win_rate_vs_reference=0.8, win_rate_vs_champion=0.6,
    kl_to_reference=2.5, mean_length=4.4, reference_mean_length=4.0, degenerate_rate=0.01, generation_failures=0.0,
    audit_score_mean=0.9, audit_win_rate_vs_reference=0.75,
)
WEAK_CHAMPION = replace(CHAMPION, accuracy=0.40)  # isolates the accuracy-vs-reference check


def only(code: str, changes: dict, champion: EvalFigures = CHAMPION):
    """A table row: these changes to GOOD are rejected for exactly this reason."""
    return pytest.param(changes, champion, [code], id=code)


def codes(decision: Decision) -> list[str]:
    return [r.split(":")[0] for r in decision.reasons]


def by_name(decision: Decision) -> dict:
    return {c.name: c for c in decision.checks}


@pytest.mark.parametrize(
    "changes,champion,expected",
    [
        pytest.param({}, CHAMPION, [], id="passes-everything"),
        only("accuracy_below_reference", {"accuracy": 0.44}, WEAK_CHAMPION),
        only("accuracy_regressed_vs_champion", {"accuracy": 0.70}),
        only("win_rate_vs_reference_too_low", {"win_rate_vs_reference": 0.5}),
        only("win_rate_vs_champion_too_low", {"win_rate_vs_champion": 0.4}),
        only("wins_on_proxy_only", {"audit_win_rate_vs_reference": 0.6}),
        only("kl_above_max", {"kl_to_reference": 6.0}),
        only("length_ratio_above_max", {"mean_length": 6.4}),
        only("degenerate_rate_above_max", {"degenerate_rate": 0.2}),
        only("generation_failures_above_max", {"generation_failures": 0.05}),
        pytest.param({"kl_to_reference": math.nan}, CHAMPION, ["kl_above_max"], id="nan-fails-closed"),
        pytest.param({"reference_mean_length": 0.0}, CHAMPION, ["length_ratio_above_max"], id="reference-length-zero"),
        pytest.param(
            {"accuracy": 0.30, "win_rate_vs_reference": 0.1, "kl_to_reference": 6.0, "degenerate_rate": 0.2},
            CHAMPION,
            ["accuracy_below_reference", "accuracy_regressed_vs_champion", "win_rate_vs_reference_too_low",
             "kl_above_max", "degenerate_rate_above_max"],
            id="several-failures-in-check-order",
        ),
    ],
)
def test_each_rejection_reports_exactly_its_reasons(changes, champion, expected):
    decision = gate(replace(GOOD, **changes), REFERENCE, champion, T)
    assert codes(decision) == expected
    assert decision.passed is (expected == [])
    assert [c.name for c in decision.checks] == CHECK_ORDER
    assert [c.name for c in decision.checks if not c.passed] == [
        c.name for c in decision.checks if c.reason is not None
    ]


@pytest.mark.parametrize(
    "check,changes,reference,champion",
    [
        # 0.55 + 0.05 == 0.6000000000000001 and 0.26 - 0.02 == 0.24000000000000002 in floats:
        # without the gate's tolerance, these accuracies would be rejected at their own threshold.
        pytest.param("accuracy_vs_reference", {"accuracy": 0.6}, replace(REFERENCE, accuracy=0.55), WEAK_CHAMPION,
                     id="accuracy=reference+gain"),
        pytest.param("accuracy_vs_champion", {"accuracy": 0.24}, replace(REFERENCE, accuracy=0.1),
                     replace(CHAMPION, accuracy=0.26), id="accuracy=champion-regression"),
        pytest.param("win_rate_vs_reference", {"win_rate_vs_reference": 0.55}, REFERENCE, CHAMPION,
                     id="win-rate-vs-reference=min"),
        pytest.param("win_rate_vs_champion", {"win_rate_vs_champion": 0.5}, REFERENCE, CHAMPION,
                     id="win-rate-vs-champion=min"),
        pytest.param("kl_to_reference", {"kl_to_reference": 5.0}, REFERENCE, CHAMPION, id="kl=max"),
        pytest.param("length_ratio", {"mean_length": 6.0}, REFERENCE, CHAMPION, id="length-ratio=max"),
        pytest.param("degenerate_rate", {"degenerate_rate": 0.05}, REFERENCE, CHAMPION, id="degenerate=max"),
        pytest.param("generation_failures", {"generation_failures": 0.01}, REFERENCE, CHAMPION, id="failures=max"),
    ],
)
def test_a_value_equal_to_its_threshold_passes(check, changes, reference, champion):
    decision = gate(replace(GOOD, **changes), reference, champion, T)
    assert decision.passed, decision.reasons
    c = by_name(decision)[check]
    assert c.observed == pytest.approx(c.threshold)


@pytest.mark.parametrize(
    "candidate,reference,champion,skipped",
    [
        pytest.param(
            replace(GOOD, win_rate_vs_champion=None), REFERENCE, None,
            {"accuracy_vs_champion": "no champion", "win_rate_vs_champion": "no champion"},
            id="no-champion",
        ),
        pytest.param(
            replace(GOOD, accuracy=None), replace(REFERENCE, accuracy=None), replace(CHAMPION, accuracy=None),
            {"accuracy_vs_reference": "no answers", "accuracy_vs_champion": "no answers"},
            id="no-answers",
        ),
        pytest.param(
            replace(GOOD, accuracy=None, win_rate_vs_champion=None), replace(REFERENCE, accuracy=None), None,
            {"accuracy_vs_reference": "no answers", "accuracy_vs_champion": "no champion",
             "win_rate_vs_champion": "no champion"},
            id="no-answers-no-champion",
        ),
    ],
)
def test_checks_without_data_are_skipped_not_failed(candidate, reference, champion, skipped):
    decision = gate(candidate, reference, champion, T)
    assert decision.passed and decision.reasons == ()
    assert {c.name: c.skipped for c in decision.checks if c.skipped} == skipped
    assert all(c.observed is None and c.threshold is None for c in decision.checks if c.skipped)


def test_no_champion_still_runs_the_other_checks():
    decision = gate(replace(GOOD, win_rate_vs_champion=None, kl_to_reference=9.0), REFERENCE, None, T)
    assert codes(decision) == ["kl_above_max"]


def test_reasons_explain_the_numbers():
    (reason,) = gate(replace(GOOD, accuracy=0.44), REFERENCE, WEAK_CHAMPION, T).reasons
    assert reason == "accuracy_below_reference: accuracy 0.44 < reference 0.4 + min gain 0.05 = 0.45"
    (reason,) = gate(replace(GOOD, kl_to_reference=6.0), REFERENCE, CHAMPION, T).reasons
    assert reason == "kl_above_max: KL to reference 6 > max 5"


@pytest.mark.parametrize(
    "candidate,champion",
    [
        pytest.param(GOOD, CHAMPION, id="passing"),
        pytest.param(replace(GOOD, kl_to_reference=6.0, mean_length=9.0), CHAMPION, id="failing"),
        pytest.param(replace(GOOD, win_rate_vs_champion=None), None, id="skipping"),
    ],
)
def test_to_markdown_mentions_every_check(candidate, champion):
    decision = gate(candidate, REFERENCE, champion, T)
    md = decision.to_markdown()
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| check")]
    assert [row.split("|")[1].strip() for row in rows] == CHECK_ORDER
    assert md.count("❌") == len(decision.reasons) + (not decision.passed)  # rows + the verdict line
    assert all(reason in md for reason in decision.reasons)


def test_to_dict_is_json_ready():
    decision = gate(replace(GOOD, kl_to_reference=6.0), REFERENCE, CHAMPION, T)
    d = json.loads(json.dumps(decision.to_dict()))
    assert d["passed"] is False and d["reasons"] == list(decision.reasons)
    assert [c["name"] for c in d["checks"]] == CHECK_ORDER
    assert d["status"] == "rejected" and d["undecided"] == []
    assert d["checks"][6] == {"name": "kl_to_reference", "passed": False, "observed": 6.0, "threshold": 5.0,
                              "op": "<=", "skipped": None, "reason": decision.reasons[0], "undecided": None,
                              "low": None, "high": None}


@pytest.mark.parametrize(
    "candidate,reference,champion,match",
    [
        pytest.param(replace(GOOD, accuracy=None), REFERENCE, CHAMPION, "candidate and reference",
                     id="accuracy-vs-none"),
        pytest.param(GOOD, REFERENCE, replace(CHAMPION, accuracy=None), "candidate and champion",
                     id="champion-no-accuracy"),
        pytest.param(replace(GOOD, win_rate_vs_champion=None), REFERENCE, CHAMPION, "win_rate_vs_champion",
                     id="champion-no-win-rate"),
        pytest.param(GOOD, REFERENCE, None, "win_rate_vs_champion", id="win-rate-without-champion"),
    ],
)
def test_inconsistent_figures_are_a_caller_error(candidate, reference, champion, match):
    with pytest.raises(ValueError, match=match):
        gate(candidate, reference, champion, T)


@pytest.mark.parametrize(
    "field,value", [("degenerate_rate", 1.5), ("win_rate_vs_reference", -0.1), ("mean_length", -1.0)]
)
def test_figures_out_of_range_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        replace(GOOD, **{field: value})


@pytest.mark.parametrize(
    "gates,problem",
    [
        ({"max_kl": 0}, "gates.max_kl: must be > 0, got 0"),
        ({"max_degenerate_rate": 1.5}, "gates.max_degenerate_rate: must be <= 1, got 1.5"),
        ({"min_accuracy_gain": -2}, "gates.min_accuracy_gain: must be >= -1, got -2"),
        ({"eval_prompts": 0}, "gates.eval_prompts: must be >= 1, got 0"),
        ({"threshold": 1}, "gates.threshold: unknown key"),
    ],
)
def test_gate_config_bounds(gates, problem):
    with pytest.raises(ConfigError) as exc:
        parse_config({"gates": gates})
    assert exc.value.problems == [problem]


def test_gate_config_defaults_are_conservative():
    cfg = parse_config({})
    assert cfg.gates.auto_promote is False
    assert gate(GOOD, REFERENCE, CHAMPION, cfg.gates).passed


def test_a_win_on_the_proxy_alone_is_rejected_by_the_audit_with_both_figures():
    """The hacked policy's signature: the reward model it trained on prefers it, a reward model
    it never saw does not. The reason names the audit and shows the proxy's figure beside it."""
    hacked = replace(GOOD, win_rate_vs_reference=0.95, audit_win_rate_vs_reference=0.1)
    decision = gate(hacked, REFERENCE, CHAMPION, T.model_copy(update={"max_proxy_audit_gap": None}))
    assert codes(decision) == ["audit_rejects_candidate"]
    assert decision.reasons[0] == ("audit_rejects_candidate: win rate vs reference under the audit reward model "
                                   "(the proxy's: 0.95) 0.1 < min 0.5")


def test_the_audit_check_is_skipped_without_an_audit_model():
    decision = gate(replace(GOOD, audit_score_mean=None, audit_win_rate_vs_reference=None), REFERENCE, CHAMPION, T)
    assert decision.passed
    assert by_name(decision)["audit_vs_reference"].skipped == "no audit model"


def test_a_candidate_the_audit_prefers_less_than_the_proxy_does_is_rejected_when_the_gap_is_set():
    """The hacked demo policies' figures: both models prefer them to the reference, the audit
    (kept current by preference rounds) much less so."""
    hacked = replace(GOOD, win_rate_vs_reference=0.998, audit_win_rate_vs_reference=0.823)
    decision = gate(hacked, REFERENCE, CHAMPION, T)
    assert codes(decision) == ["wins_on_proxy_only"]
    assert decision.reasons[0] == ("wins_on_proxy_only: win rate vs reference 0.998 under the proxy but 0.823 "
                                   "under the audit: gap 0.175 > max 0.1")
    assert gate(hacked, REFERENCE, CHAMPION, T.model_copy(update={"max_proxy_audit_gap": None})).passed
    assert by_name(gate(hacked, REFERENCE, CHAMPION, T.model_copy(update={"max_proxy_audit_gap": None}))
                   )["proxy_audit_gap"].skipped == "gates.max_proxy_audit_gap not set"


# --- the audit checks on intervals --------------------------------------------------------

def audit_on_intervals(audit: Interval, gap: Interval | None = None) -> EvalFigures:
    """GOOD with the audit's figures judged on these intervals (point estimates = their estimates)."""
    return replace(GOOD, audit_win_rate_vs_reference=audit.estimate, audit_win_rate_vs_reference_interval=audit,
                   proxy_audit_gap_interval=gap)


NO_GAP = T.model_copy(update={"max_proxy_audit_gap": None})


def test_an_audit_interval_above_the_bar_passes():
    decision = gate(audit_on_intervals(Interval(0.75, 0.68, 0.81, 0.95, 200)), REFERENCE, CHAMPION, NO_GAP)
    assert decision.passed
    c = by_name(decision)["audit_vs_reference"]
    assert (c.observed, c.low, c.high, c.threshold, c.op) == (0.75, 0.68, 0.81, 0.5, ">=")


def test_an_audit_interval_below_the_bar_rejects_the_candidate_with_the_proxy_beside_it():
    """The hacked policy's signature on intervals: the whole interval is under the bar."""
    hacked = replace(audit_on_intervals(Interval(0.1, 0.06, 0.14, 0.95, 200)), win_rate_vs_reference=0.95)
    decision = gate(hacked, REFERENCE, CHAMPION, NO_GAP)
    assert decision.status == "rejected" and codes(decision) == ["audit_rejects_candidate"]
    assert decision.reasons[0] == ("audit_rejects_candidate: win rate vs reference under the audit reward model "
                                   "(the proxy's: 0.95) 0.1 [0.06, 0.14] (95%, 200 prompts) < min 0.5")


def test_an_audit_interval_across_the_bar_is_undecided_where_the_point_estimate_passes():
    straddling = audit_on_intervals(Interval(0.55, 0.48, 0.62, 0.95, 200))
    decision = gate(straddling, REFERENCE, CHAMPION, NO_GAP)
    assert decision.status == "undecided" and decision.reasons == ()
    [open_call] = decision.undecided
    assert open_call.startswith("audit_vs_reference: win rate vs reference under the audit reward model")
    assert "about 392 prompts would decide it" in open_call  # 200 * (0.07 / 0.05)^2
    assert gate(replace(straddling, audit_win_rate_vs_reference_interval=None), REFERENCE, CHAMPION, NO_GAP).passed


def test_an_audit_interval_whose_low_end_is_on_the_bar_is_undecided_as_the_win_rate_is():
    """`_better_than`: a low end above the bar passes, one on it does not (as for win_rate_vs_reference)."""
    decision = gate(audit_on_intervals(Interval(0.55, 0.5, 0.6, 0.95, 200)), REFERENCE, CHAMPION, NO_GAP)
    assert decision.status == "undecided" and by_name(decision)["audit_vs_reference"].undecided


PASSING_AUDIT = Interval(0.75, 0.68, 0.81, 0.95, 200)


@pytest.mark.parametrize("gap", [Interval(0.05, 0.02, 0.08, 0.95, 200), Interval(0.06, 0.02, 0.1, 0.95, 200)],
                         ids=["below-max", "high-end-at-max"])
def test_a_gap_interval_at_or_below_the_max_passes(gap):
    decision = gate(audit_on_intervals(PASSING_AUDIT, gap), REFERENCE, CHAMPION, T)
    assert decision.passed, decision.undecided
    c = by_name(decision)["proxy_audit_gap"]
    assert (c.observed, c.low, c.high, c.threshold, c.op) == (gap.estimate, gap.low, gap.high, 0.1, "<=")


def test_a_gap_interval_above_the_max_rejects_the_candidate_as_winning_on_the_proxy_only():
    hacked = replace(audit_on_intervals(Interval(0.823, 0.77, 0.87, 0.95, 200), Interval(0.175, 0.12, 0.23, 0.95, 200)),
                     win_rate_vs_reference=0.998)
    decision = gate(hacked, REFERENCE, CHAMPION, T)
    assert decision.status == "rejected" and codes(decision) == ["wins_on_proxy_only"]
    assert decision.reasons[0] == ("wins_on_proxy_only: win rate vs reference 0.998 under the proxy but 0.823 "
                                   "under the audit: gap 0.175 [0.12, 0.23] (95%, 200 prompts) > max 0.1")


def test_a_gap_interval_across_the_max_is_undecided_where_the_point_estimate_rejects():
    figures = replace(audit_on_intervals(Interval(0.8, 0.74, 0.86, 0.95, 200), Interval(0.13, 0.07, 0.19, 0.95, 200)),
                      win_rate_vs_reference=0.93)
    decision = gate(figures, REFERENCE, CHAMPION, T)
    assert decision.status == "undecided" and decision.reasons == ()
    [open_call] = decision.undecided
    assert open_call.startswith("proxy_audit_gap: win rate vs reference 0.93 under the proxy but 0.8 under the audit")
    assert "about 800 prompts would decide it" in open_call  # 200 * (0.06 / 0.03)^2, toward rejection
    assert codes(gate(replace(figures, proxy_audit_gap_interval=None), REFERENCE, CHAMPION, T)) == [
        "wins_on_proxy_only"]


def test_a_gap_estimate_on_the_max_is_decided_by_no_number_of_prompts():
    figures = replace(audit_on_intervals(PASSING_AUDIT, Interval(0.1, 0.06, 0.14, 0.95, 200)),
                      win_rate_vs_reference=0.85)
    [open_call] = gate(figures, REFERENCE, CHAMPION, T).undecided
    assert "no number of prompts decides it: the estimate is on the bar" in open_call


def test_the_gap_interval_is_not_judged_when_the_gap_is_off_nor_the_audit_without_an_audit_model():
    figures = audit_on_intervals(PASSING_AUDIT, Interval(0.4, 0.3, 0.5, 0.95, 200))
    assert by_name(gate(figures, REFERENCE, CHAMPION, NO_GAP))["proxy_audit_gap"].skipped == (
        "gates.max_proxy_audit_gap not set")
    no_audit = replace(figures, audit_score_mean=None, audit_win_rate_vs_reference=None)
    decision = gate(no_audit, REFERENCE, CHAMPION, T)
    assert decision.passed
    assert {c.name: c.skipped for c in decision.checks if c.skipped} == {
        "audit_vs_reference": "no audit model", "proxy_audit_gap": "no audit model"}


# --- regression suites ---------------------------------------------------------------------

WITH_SUITE = T.model_copy(update={"regression_suites": GateConfig(
    regression_suites=[{"name": "no_carry", "path": "suite.jsonl", "margin": 0.05}]).regression_suites})
RIGHT = [True] * 40  # the reference answers every row of the suite right


def on_suite(correct: list[bool], vs_reference: list[bool] = RIGHT, vs_champion: list[bool] | None = None,
             intervals: bool = True) -> SuiteFigures:
    """A policy's figures on the suite from its per-row outcomes, intervals drawn as evaluate draws them."""
    def interval(baseline):
        if baseline is None or not intervals:
            return None
        return bootstrap_interval(differences(correct, baseline), 0.95, 2000, seed=0)

    return SuiteFigures("no_carry", sum(correct) / len(correct), interval(vs_reference), interval(vs_champion))


def suite_gate(candidate: SuiteFigures, champion: SuiteFigures | None = None):
    """GOOD, REFERENCE (every row right) and CHAMPION (or none) with these suite figures."""
    return gate(replace(GOOD, regression=(candidate,), win_rate_vs_champion=None if champion is None else 0.6),
                replace(REFERENCE, regression=(on_suite(RIGHT),)),
                None if champion is None else replace(CHAMPION, regression=(champion,)), WITH_SUITE)


def test_a_candidate_that_answers_the_suite_as_the_reference_does_passes_on_a_zero_interval():
    decision = suite_gate(on_suite(RIGHT, vs_champion=RIGHT), champion=on_suite(RIGHT))
    assert decision.passed, decision.to_markdown()
    assert [c.name for c in decision.checks] == CHECK_ORDER + ["regression_vs_reference:no_carry",
                                                               "regression_vs_champion:no_carry"]
    c = by_name(decision)["regression_vs_reference:no_carry"]
    assert (c.observed, c.low, c.high, c.threshold, c.op) == (0.0, 0.0, 0.0, -0.05, ">=")


def test_a_candidate_that_lost_every_row_the_reference_got_right_is_rejected_with_both_scores_and_the_interval():
    decision = suite_gate(on_suite([False] * 40))
    assert decision.status == "rejected" and codes(decision) == ["regression"]
    assert decision.reasons == (("regression:no_carry: suite no_carry: accuracy 0 vs the reference's 1, difference "
                                 "-1 [-1, -1] (95%, 40 prompts) < -margin -0.05"),)
    assert by_name(decision)["regression_vs_champion:no_carry"].skipped == "no champion"


def test_a_candidate_as_good_as_the_reference_but_worse_than_the_champion_is_rejected_against_the_champion():
    """The reference and the candidate miss rows 0-9; the champion answers them all."""
    missed = [False] * 10 + [True] * 30
    candidate = on_suite(missed, vs_reference=missed, vs_champion=RIGHT)
    decision = gate(replace(GOOD, regression=(candidate,)), replace(REFERENCE, regression=(on_suite(missed, missed),)),
                    replace(CHAMPION, regression=(on_suite(RIGHT, missed),)), WITH_SUITE)
    assert codes(decision) == ["regression"]
    assert by_name(decision)["regression_vs_reference:no_carry"].passed
    assert decision.reasons[0].startswith(
        "regression:no_carry: suite no_carry: accuracy 0.75 vs the champion's 1, difference -0.25 [")


def test_a_suite_difference_across_the_margin_is_undecided_and_on_point_estimates_decided():
    """Two rows of forty lost: -0.05 is the estimate, and the interval reaches below -margin."""
    two_lost = [False, False] + [True] * 38
    decision = suite_gate(on_suite(two_lost))
    assert decision.status == "undecided", decision.to_markdown()
    assert decision.undecided[0].startswith("regression_vs_reference:no_carry: suite no_carry: accuracy 0.95")
    assert suite_gate(on_suite(two_lost, intervals=False)).passed  # -0.05 on the margin passes
    assert codes(suite_gate(on_suite([False] * 3 + [True] * 37, intervals=False))) == ["regression"]


def test_a_better_candidate_on_the_suite_passes():
    decision = gate(replace(GOOD, win_rate_vs_champion=None, regression=(on_suite(RIGHT, vs_reference=[False] * 40),)),
                    replace(REFERENCE, regression=(on_suite([False] * 40),)), None, WITH_SUITE)
    assert decision.passed
    assert by_name(decision)["regression_vs_reference:no_carry"].low == 1.0


@pytest.mark.parametrize("who", ["candidate", "reference"])
def test_suite_figures_that_do_not_match_the_configured_suites_are_a_caller_error(who):
    figures = {"candidate": replace(GOOD, win_rate_vs_champion=None, regression=(on_suite(RIGHT),)),
               "reference": replace(REFERENCE, regression=(on_suite(RIGHT),))}
    figures[who] = replace(figures[who], regression=())
    with pytest.raises(ValueError, match=f"the {who}'s regression figures"):
        gate(figures["candidate"], figures["reference"], None, WITH_SUITE)


def test_suite_accuracy_out_of_range_is_rejected():
    with pytest.raises(ValueError, match="regression suite x: accuracy"):
        SuiteFigures("x", 1.5)


def test_without_suites_the_checks_are_the_tasks_alone():
    assert [c.name for c in gate(GOOD, REFERENCE, CHAMPION, T).checks] == CHECK_ORDER
    assert GateConfig().regression_suites == []
