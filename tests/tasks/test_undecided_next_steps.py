"""What an undecided run tells a person to do: the commands are built from the looks that
ended undecided and the open calls, and each names the run's config unless it is the default."""
from pathlib import Path

from rlhf_core.eval.checks import Check, Decision
from rlhf_core.eval.evaluate import EvalResult, PolicyReport
from rlhf_core.eval.gates import EvalFigures, SuiteFigures
from rlhf_core.eval.sequential import Look
from tasks.evaluate import Evaluation, undecided_next_steps


def evaluation(suites: tuple[SuiteFigures, ...], open_checks: tuple[str, ...]) -> Evaluation:
    figures = EvalFigures(accuracy=0.9, rm_score_mean=0.0, win_rate_vs_reference=0.5, win_rate_vs_champion=None,
                          kl_to_reference=1.0, mean_length=3, reference_mean_length=3, degenerate_rate=0,
                          generation_failures=0, regression=suites)
    report = PolicyReport("candidate", figures, [], {}, [], [])
    checks = tuple(Check(name, False, 0.0, 0.0, ">=", undecided=f"{name}: open") for name in open_checks)
    result = EvalResult(report, report, None, num_prompts=200)
    return Evaluation(None, result, Decision.from_checks(checks), None, "run", Path("gate_report.json"))


def look(rows, stopped):
    return Look(rows, 0.98, {"estimate": -0.03}, None, stopped)


def test_more_rows_for_each_suite_whose_looks_ended_open_and_for_the_eval_prompts():
    suites = (SuiteFigures("decided", 1.0, looks=(look(200, "decided"),)),
              SuiteFigures("no_carry", 0.97, looks=(look(200, None), look(400, None), look(800, "budget of 800 rows reached"))))
    steps = undecided_next_steps(evaluation(suites, ("regression_vs_reference:no_carry", "accuracy_vs_champion")),
                                 "4", None)
    assert steps == {"look at more rows": "rlhf evaluate 4 --set gates.regression_suites.1.max_rows=1600 "
                                          "--set gates.max_eval_prompts=400",
                     "or promote it anyway": 'rlhf promote 4 --force --reason "..."'}
    only_suite = undecided_next_steps(evaluation(suites, ("regression_vs_reference:no_carry",)), "4", "configs/chat.yaml")
    assert only_suite["look at more rows"] == ("rlhf evaluate 4 --config configs/chat.yaml "
                                               "--set gates.regression_suites.1.max_rows=1600")
    assert only_suite["or promote it anyway"].startswith("rlhf promote 4 --config configs/chat.yaml --force")


def test_an_eval_set_with_no_more_prompts_asks_for_rows_not_for_a_larger_budget():
    from rlhf_core.eval.sequential import EvalLook

    spent = evaluation((), ("proxy_audit_gap",))
    spent.result.looks = (EvalLook(200, 0.99, {}, ("proxy_audit_gap",), None),
                          EvalLook(300, 0.98, {}, ("proxy_audit_gap",), "the eval set has no more prompts (300)"))
    spent.result.num_prompts = 300
    steps = undecided_next_steps(spent, "4", None)
    assert steps["look at more rows"] == "rlhf evaluate 4"  # nothing left for a budget to draw
    assert steps["add eval prompts"].startswith("all 300 prompts of the eval set left proxy_audit_gap open")
    budget = evaluation((), ("proxy_audit_gap",))
    budget.result.looks = (EvalLook(200, 0.95, {}, ("proxy_audit_gap",), "budget of 200 prompts reached"),)
    assert undecided_next_steps(budget, "4", None)["look at more rows"] == (
        "rlhf evaluate 4 --set gates.max_eval_prompts=400")
