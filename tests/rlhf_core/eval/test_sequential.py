"""Looks at a regression suite that can give more rows: the plan against its closed forms, a
generated suite that draws more rows and decides, a fixed one that stops at its budget and says
so, and the whole procedure's false-pass rate on simulated candidates at the margin."""
from __future__ import annotations

import math

import numpy as np
import pytest

from rlhf_core.eval.confidence import paired_score_interval
from rlhf_core.eval.regression import run_looks
from rlhf_core.eval.sequential import decidable_gap, look_levels, look_sizes, rows_to_decide, spent


def test_looks_double_the_rows_up_to_the_budget():
    assert look_sizes(200, 1600) == (200, 400, 800, 1600)
    assert look_sizes(200, 500) == (200, 400, 500)
    assert look_sizes(200, 200) == (200,)
    with pytest.raises(ValueError, match="first rows <= budget"):
        look_sizes(300, 200)


def test_the_looks_spend_exactly_the_error_rate_and_one_look_keeps_the_fixed_level():
    sizes = look_sizes(200, 1600)
    levels = look_levels(sizes, 0.95)
    assert math.isclose(sum(1 - level for level in levels), 0.05, rel_tol=1e-12)  # the union bound's total
    # Pocock-type spending in closed form: alpha ln(1 + (e - 1) t)
    assert math.isclose(1 - levels[0], 0.05 * math.log(1 + (math.e - 1) / 8), rel_tol=1e-12)
    assert all(0.95 < level < 1 for level in levels)
    assert look_levels((200,), 0.95) == pytest.approx((0.95,))
    assert spent(0.05, 1.0) == pytest.approx(0.05)


def stream_looks(candidate_right, reference_right, first, budget, margin=0.05, confidence=0.95, available=None):
    """`run_looks` over fixed per-row outcomes: answering n rows reveals the first n of each."""
    seen = [0]

    def answer_to(n):
        seen[0] = n

    def intervals(level):
        n = seen[0]
        return paired_score_interval(candidate_right[:n], reference_right[:n], level), None

    return run_looks(first, len(candidate_right) if available is None else available, budget, margin, confidence,
                     answer_to, intervals)


def test_an_undecided_call_on_a_generated_suite_draws_more_rows_and_decides():
    """A candidate that loses 3% of what the reference gets right, with a margin of 5%: 200 rows
    leave it open (the case of the demo on one CPU kind), the looks go on until they pass it."""
    rng = np.random.default_rng(0)
    reference = np.ones(1600, dtype=bool)
    candidate = rng.random(1600) >= 0.03
    looks = stream_looks(candidate, reference, first=200, budget=1600)
    assert len(looks) > 1 and [look.rows for look in looks] == [200, 400, 800, 1600][:len(looks)]
    assert all(look.stopped is None for look in looks[:-1]) and looks[-1].stopped == "decided"
    assert looks[0].vs_reference["low"] < -0.05 <= looks[-1].vs_reference["low"]  # open at first, then passed
    assert looks[-1].vs_reference["n"] == looks[-1].rows and looks[-1].level == pytest.approx(
        look_levels(look_sizes(200, 1600), 0.95)[len(looks) - 1])


def test_a_fixed_suite_stops_at_its_budget_and_says_so():
    rng = np.random.default_rng(1)
    reference = np.ones(300, dtype=bool)
    candidate = rng.random(300) >= 0.04
    [look] = stream_looks(candidate, reference, first=300, budget=300)  # a file used whole: one look
    assert look.stopped == "budget of 300 rows reached" and look.level == pytest.approx(0.95)
    looks = stream_looks(candidate, reference, first=100, budget=800, available=300)  # asks more than it has
    assert [look.rows for look in looks] == [100, 200, 300][:len(looks)]
    assert looks[-1].stopped in ("decided", "the suite has no more rows (300)")
    assert stream_looks(candidate, reference, first=100, budget=800, available=300, margin=0.04)[-1].stopped == (
        "the suite has no more rows (300)")


def test_a_decided_first_look_answers_no_more_rows():
    same = np.ones(1600, dtype=bool)
    [look] = stream_looks(same, same, first=200, budget=1600)
    assert (look.rows, look.stopped) == (200, "decided") and -0.05 < look.vs_reference["low"] < 0


def test_the_false_pass_rate_of_the_whole_procedure_is_at_most_its_level():
    """Candidates exactly at the margin (wrong on 5% of rows the reference gets right), where a
    pass is a false one: over 300 simulated suites the looks pass at most the one-sided alpha/2
    a single 95% interval claims. Repeated 95% intervals at the same looks pass more often."""
    rng = np.random.default_rng(7)
    margin, first, budget, sims = 0.05, 100, 800, 300
    passed = naive = 0
    for _ in range(sims):
        reference = np.ones(budget, dtype=bool)
        candidate = rng.random(budget) >= margin
        looks = stream_looks(candidate, reference, first, budget, margin=margin)
        passed += looks[-1].stopped == "decided" and looks[-1].vs_reference["low"] >= -margin
        naive += any(paired_score_interval(candidate[:n], reference[:n], 0.95).low >= -margin
                     for n in look_sizes(first, budget))
    assert passed / sims <= 0.025
    assert naive > passed


def test_the_power_calculation_matches_its_closed_form():
    # margin 0.05 at 95%: p = 0.025, n = (1.96 sqrt(p (1 - p)) / p)^2 = 149.8
    assert rows_to_decide(0.05, 0.95) == 150
    assert decidable_gap(150, 0.05, 0.95) == pytest.approx(0.025, rel=0.01)
    assert decidable_gap(600, 0.05, 0.95) == pytest.approx(decidable_gap(150, 0.05, 0.95) / 2)


def test_the_paired_score_interval_against_its_closed_forms():
    """With the reference right on every row the interval's low end is the Wilson lower bound of
    the candidate's accuracy, less 1; swapping the two policies mirrors the interval."""
    z = 1.959963984540054
    n, wrong = 200, 6
    candidate = np.arange(n) >= wrong
    reference = np.ones(n, dtype=bool)
    p = 1 - wrong / n
    wilson_low = (p + z * z / (2 * n) - z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (1 + z * z / n)
    i = paired_score_interval(candidate, reference, 0.95)
    assert i.estimate == pytest.approx(-0.03) and i.n == n and i.low == pytest.approx(wilson_low - 1, abs=1e-12)
    mirrored = paired_score_interval(reference, candidate, 0.95)
    assert (mirrored.low, mirrored.high) == pytest.approx((-i.high, -i.low))
    agree = paired_score_interval(reference, reference, 0.95)  # 0/200 discordant rows: not certainty
    assert agree.estimate == 0 and -0.03 < agree.low < 0 < agree.high < 0.03


def test_each_look_answers_only_the_new_rows_and_every_policy_gets_the_same_rows(monkeypatch):
    """Through `evaluate.suite_figures`: a candidate wrong on every 33rd row (3%) of a 1,600-row
    suite whose first look is 200 rows is looked at until decided; each look asks every policy
    for the rows after the last look's only, and the figures cover exactly the rows answered."""
    from types import SimpleNamespace

    from rlhf_core.eval import evaluate
    from rlhf_core.eval.regression import RegressionSuite

    asked = []

    def answer(policy, prompts, max_new_tokens):
        asked.append((policy.name, prompts[0], len(prompts)))
        wrong = policy.name == "candidate"
        return evaluate.Answers(["b" if wrong and int(p[1:]) % 33 == 0 else "a" for p in prompts], [])

    monkeypatch.setattr(evaluate, "answer", answer)
    suite = RegressionSuite("s", None, "answer_exact_match", 0.05, [f"p{i}" for i in range(1600)], ["a"] * 1600,
                            first_rows=200, max_rows=1600)
    candidate, reference = SimpleNamespace(name="candidate"), SimpleNamespace(name="reference")
    figures = evaluate.suite_figures(candidate, reference, None, [suite], 4, 0.95)
    [mine], [ref] = figures["candidate"], figures["reference"]
    rows = mine.looks[-1].rows
    assert [look.rows for look in mine.looks] == [200, 400, 800, 1600][:len(mine.looks)] and len(mine.looks) > 1
    assert mine.looks[-1].stopped == "decided" and mine.diff_vs_reference.n == rows
    assert mine.accuracy == 1 - len(range(0, rows, 33)) / rows and ref.accuracy == 1.0 and ref.looks == ()
    starts = [0, *(look.rows for look in mine.looks[:-1])]
    assert asked == [(who, f"p{start}", end - start) for start, end in zip(starts, [look.rows for look in mine.looks])
                     for who in ("candidate", "reference")]
