"""The gates' answers from serving's kind of engine (`rlhf_core.eval.served`): asked tier by tier,
one engine a session, closed after it. The engine here is a recorder of what it is asked; the
real one (vLLM) answers the gates in tests/rlhf_core/distributed/test_stage_task.py."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from rlhf_core.config import PipelineConfig
from rlhf_core.eval.gate_models import answer_tiers
from rlhf_core.eval.regression import RegressionSuite
from rlhf_core.eval.served import ServedAnswers


@dataclass
class Said:
    response_text: str


class Recorder:
    """An engine that answers a prompt with its reverse, refuses `refused`, and records its batches."""

    def __init__(self, refused: frozenset[str] = frozenset()):
        self.batches: list[list[str]] = []
        self.sessions: list[tuple[int, int]] = []
        self.open = 0
        self.refused = refused

    def __call__(self, model_dir: Path, max_num_seqs: int, max_model_len: int) -> Recorder:
        assert self.open == 0, "a second engine opened while one was open"
        self.open += 1
        self.sessions.append((max_num_seqs, max_model_len))
        return self

    def generate(self, prompts, n, temperature, max_tokens):
        assert (n, temperature, max_tokens) == (1, 0.0, 4)
        self.batches.append(list(prompts))
        if self.refused.intersection(prompts):
            raise RuntimeError("refused")
        return [Said(p[::-1]) for p in prompts]

    def close(self) -> None:
        self.open -= 1


def served(recorder: Recorder, tiers) -> ServedAnswers:
    return ServedAnswers(Path("policy"), recorder, max_new_tokens=4, max_model_len=32, tiers=tiers)


def test_the_first_tier_is_answered_in_one_session_and_the_rest_only_when_a_look_asks_for_it():
    engine = Recorder()
    answers = served(engine, (("p0", "p1", "s0"), ("p2", "p3", "s1")))
    assert answers.answer(["p0", "p1"], 4).texts == ["0p", "1p"]
    assert engine.batches == [["p0", "p1", "s0"]] and engine.sessions == [(3, 32)]
    assert answers.answer(["s0"], 4).texts == ["0s"] and answers.sessions == 1  # the suite's first look: no session
    assert answers.answer(["p2"], 4).texts == ["2p"]
    assert engine.batches[1] == ["p2", "p3", "s1"] and answers.sessions == 2  # the rest of the budget, at once
    assert answers.answer(["s1", "p3", "p0"], 4).texts == ["1s", "3p", "0p"] and answers.sessions == 2
    assert engine.open == 0
    assert answers.answer(["unplanned"], 4).texts == ["dennalpnu"] and answers.sessions == 3


def test_a_prompt_the_engine_refuses_is_a_failure_and_the_rest_of_its_batch_is_answered():
    engine = Recorder(refused=frozenset({"p1"}))
    out = served(engine, (("p0", "p1", "p2"),)).answer(["p2", "p1", "p0"], 4)
    assert out.texts == ["2p", "", "0p"] and out.failed_prompts == [1]
    assert engine.batches == [["p2", "p1", "p0"], ["p2"], ["p1"], ["p0"]] and engine.open == 0


def test_answers_of_another_length_are_refused():
    with pytest.raises(ValueError, match="answers of 4 tokens, asked for 8"):
        served(Recorder(), (("p0",),)).answer(["p0"], 8)


def test_the_tiers_are_the_first_looks_then_what_later_looks_may_ask():
    suite = RegressionSuite("s", Path("s.jsonl"), "answer_exact_match", 0.05, [f"s{i}" for i in range(6)],
                            ["0"] * 6, first_rows=2, max_rows=4)
    prompts = [f"p{i}" for i in range(10)]
    cfg = PipelineConfig.model_validate({"gates": {"eval_prompts": 3, "max_eval_prompts": 8}})
    first, later = answer_tiers(prompts, [suite], cfg)
    assert first == ("p0", "p1", "p2", "s0", "s1")
    assert later == ("p3", "p4", "p5", "p6", "p7", "s2", "s3")
    no_looks = cfg.model_copy(update={"gates": cfg.gates.model_copy(update={"confidence": None})})
    assert answer_tiers(prompts, [suite], no_looks) == (first, ())
