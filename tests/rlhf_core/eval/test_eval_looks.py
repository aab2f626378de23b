"""Looks at the eval prompts (`evaluate.evaluate` with a judge): a win rate left open by the
first prompts draws more and decides, an eval set that cannot give more stops and says why,
each look asks every policy for the new prompts only, and the whole procedure's false-pass rate
on simulated candidates at the bar is at most the level it claims."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rlhf_core.config import GateConfig
from rlhf_core.eval import evaluate
from rlhf_core.eval.confidence import bootstrap_interval, win_outcomes
from rlhf_core.eval.gates import gate
from rlhf_core.eval.sequential import look_levels, look_sizes


@pytest.fixture
def wins(monkeypatch):
    """Policies whose answers are their prompts' names and whose scores are set per prompt: the
    candidate beats the reference on the prompts `won` says; every policy's asks are recorded."""
    asked: list[tuple[str, str, int]] = []
    state = {"won": lambda i: True}

    def answer(policy, prompts, max_new_tokens):
        asked.append((policy.name, prompts[0], len(prompts)))
        return evaluate.Answers([f"answer {p}" for p in prompts], [])

    def scored(by, prompts, outputs):
        return {name: [(0.5 if state["won"](int(p[1:])) else -0.5) if name == "candidate" else 0.0 for p in prompts]
                for name in outputs}

    monkeypatch.setattr(evaluate, "answer", answer)
    monkeypatch.setattr(evaluate, "_scored", scored)
    monkeypatch.setattr(evaluate, "_same_vocabulary", lambda a, b: True)
    monkeypatch.setattr(evaluate, "exact_sequence_kl", lambda *args, **kwargs: 0.0)
    return SimpleNamespace(asked=asked, state=state)


def looked(n_prompts: int, first: int, budget: int | None, confidence: float = 0.95, samples: int = 2000,
           seed: int = 0) -> evaluate.EvalResult:
    gates = GateConfig(eval_prompts=first, max_eval_prompts=budget, confidence=confidence, bootstrap_samples=samples)
    candidate, reference = SimpleNamespace(name="candidate", tokenizer=None), SimpleNamespace(name="reference", tokenizer=None)
    return evaluate.evaluate(candidate, reference, None, None, [f"p{i}" for i in range(n_prompts)], None,
                             max_new_tokens=4, temperature=1.0, seed=seed, confidence=confidence,
                             bootstrap_samples=samples, first_look=first, max_prompts=budget,
                             judge=lambda c, r, ch: gate(c, r, ch, gates))


def test_an_open_win_rate_on_the_eval_prompts_draws_more_and_decides(wins):
    """A candidate that wins 56% of the prompts against the bar 0.5: 200 prompts leave the call
    open, the looks go on to twice the prompts until they pass it; each look asks every policy
    for the prompts after the last look's only."""
    wins.state["won"] = lambda i: i % 25 < 14
    result = looked(1200, first=200, budget=1200)
    sizes = [look.rows for look in result.looks]
    assert len(sizes) > 1 and sizes == [200, 400, 800, 1200][:len(sizes)]
    assert result.looks[0].open == ("win_rate_vs_reference",) and result.looks[0].stopped is None
    assert result.looks[-1].open == () and result.looks[-1].stopped == "decided"
    last = result.looks[-1]
    assert last.level == pytest.approx(look_levels(look_sizes(200, 1200), 0.95)[len(sizes) - 1])
    assert result.num_prompts == last.rows and result.candidate.figures.win_rate_vs_reference == pytest.approx(
        sum(i % 25 < 14 for i in range(last.rows)) / last.rows)
    interval = result.candidate.figures.win_rate_vs_reference_interval
    assert interval.n == last.rows and interval.level == pytest.approx(last.level) and interval.low > 0.5
    assert result.looks[0].calls["win_rate_vs_reference"]["low"] <= 0.5
    starts = [0, *sizes[:-1]]
    assert wins.asked == [(who, f"p{start}", end - start) for start, end in zip(starts, sizes)
                          for who in ("candidate", "reference")]


def test_an_eval_set_that_cannot_decide_stops_at_its_budget_or_its_last_prompt_and_says_so(wins):
    wins.state["won"] = lambda i: i % 2 == 0  # exactly the bar: no number of prompts decides it
    short = looked(300, first=200, budget=1200)
    assert [look.rows for look in short.looks] == [200, 300]
    assert short.looks[-1].stopped == "the eval set has no more prompts (300)"
    capped = looked(1200, first=200, budget=400)
    assert [look.rows for look in capped.looks] == [200, 400]
    assert capped.looks[-1].stopped == "budget of 400 prompts reached"
    [one] = looked(1200, first=200, budget=None).looks  # no budget: one look at the fixed level
    assert (one.rows, one.level, one.stopped) == (200, pytest.approx(0.95), "budget of 200 prompts reached")
    assert "win_rate_vs_reference" in one.open


def test_the_first_look_is_the_old_single_look_without_a_judge(wins):
    wins.state["won"] = lambda i: i % 25 < 14
    plain = evaluate.evaluate(SimpleNamespace(name="candidate", tokenizer=None), SimpleNamespace(name="reference", tokenizer=None), None, None,
                              [f"p{i}" for i in range(1200)], None, max_new_tokens=4, temperature=1.0,
                              confidence=0.95, first_look=200)
    assert plain.looks == () and plain.num_prompts == 200
    assert plain.candidate.figures.win_rate_vs_reference_interval.level == 0.95


def test_the_false_pass_rate_of_the_whole_procedure_is_at_most_its_level(wins):
    """Candidates that win exactly half the prompts, at the bar 0.5, where a pass is a false
    one: over 200 simulated eval sets the looks pass at most the one-sided alpha/2 that a single
    95% interval claims. Repeated 95% intervals at the same looks pass more often."""
    rng = np.random.default_rng(3)
    sims, first, budget = 200, 100, 800
    passed = naive = 0
    for sim in range(sims):
        won = rng.random(budget) < 0.5
        wins.state["won"] = lambda i: bool(won[i])
        result = looked(budget, first, budget, samples=1000, seed=sim)
        passed += result.looks[-1].stopped == "decided" and result.candidate.figures.win_rate_vs_reference > 0.5
        outcomes = win_outcomes(won.astype(float), np.full(budget, 0.5))
        naive += any(bootstrap_interval(outcomes[:n], 0.95, 1000, sim).low > 0.5 for n in look_sizes(first, budget))
    assert passed / sims <= 0.025
    assert naive > passed
