"""Regression suites: files checked by file and line before anything trains, the demo's suite
(carry-free additions the SFT corpus teaches right), row-by-row checking, and a policy that
lost what the reference could do blocked through the real evaluation on tiny models."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from rlhf_core.config import ConfigError, DemoDataConfig, GateConfig, ModelConfig, load_config, parse_config
from rlhf_core.data.demo_task import addition_target
from rlhf_core.data.synthetic import generate_demo_data, has_carry, no_carry_suite, sum_without_carry
from rlhf_core.eval.accuracy import greedy_completions
from rlhf_core.eval.evaluate import Policy, Scorer, evaluate
from rlhf_core.eval.gates import gate
from rlhf_core.eval.regression import (
    SHOWN_PROBLEMS, RegressionSuite, SuiteFormatError, correct, load_suites, read_suite, suite_report,
)
from rlhf_core.models.llama import build_policy, save_pretrained_atomic
from rlhf_core.models.reward import RewardStats, reward_model_from_base
from rlhf_core.tokenizer import train_tokenizer

REPO = Path(__file__).resolve().parents[3]


def write(path: Path, *lines: str | bytes) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


ROW = json.dumps({"prompt": "01+02=", "answer": "003"})


# --- reading a suite ------------------------------------------------------------------------

def test_a_good_suite_is_read_in_order_skipping_blank_lines_and_a_byte_order_mark(tmp_path):
    path = write(tmp_path / "s.jsonl", b"\xef\xbb\xbf" + ROW.encode(), "", json.dumps({"prompt": "p", "answer": "a",
                                                                                       "note": "kept out"}))
    assert read_suite(path) == (["01+02=", "p"], ["003", "a"])


@pytest.mark.parametrize("line,problem", [
    ("{not json", "not valid JSON"),
    ('["01+02=", "003"]', "expected a JSON object with prompt and answer, got list"),
    ('{"prompt": "01+02="}', "answer is missing"),
    ('{"answer": "003"}', "prompt is missing"),
    ('{"prompt": "  ", "answer": "003"}', "prompt is empty"),
    ('{"prompt": "01+02=", "answer": ""}', "answer is empty"),
    ('{"prompt": "01+02=", "answer": 3}', "answer must be text or (answer) a list of texts, got int"),
    ('{"prompt": "01+02=", "answer": []}', "answer as a list must hold one or more non-blank texts"),
    ('{"prompt": "01+02=", "answer": ["003", " "]}', "answer as a list must hold one or more non-blank texts"),
    ('{"prompt": "01+02=", "answer": ["003", 3]}', "answer as a list must hold one or more non-blank texts"),
    (b'{"prompt": "\xff", "answer": "003"}', "not valid UTF-8"),
    ('{"prompt": [], "answer": "Paris"}', "prompt is an empty list of messages"),
    ('{"prompt": [{"role": "user"}], "answer": "Paris"}', "prompt message 0 must be an object with text role and content"),
    ('{"prompt": [{"role": "assistant", "content": "Hi"}], "answer": "Paris"}',
     "prompt's last message is from 'assistant', not the user"),
])
def test_a_bad_row_is_named_by_file_and_line(tmp_path, line, problem):
    path = write(tmp_path / "s.jsonl", ROW, line, ROW)
    with pytest.raises(SuiteFormatError) as exc:
        read_suite(path)
    assert str(exc.value).startswith(f"{path}:2: {problem}")


def test_every_bad_row_is_counted_and_the_first_ones_named(tmp_path):
    path = write(tmp_path / "s.jsonl", ROW, *(["{}"] * (SHOWN_PROBLEMS + 2)))
    with pytest.raises(SuiteFormatError) as exc:
        read_suite(path)
    lines = str(exc.value).splitlines()
    assert lines[:2] == [f"{path}:2: prompt is missing", f"{path}:3: prompt is missing"]
    assert lines[-1] == "... and 2 more bad rows" and len(lines) == SHOWN_PROBLEMS + 1


def test_a_missing_or_empty_suite_file_is_named(tmp_path):
    with pytest.raises(SuiteFormatError, match=f"^{tmp_path / 'nope.jsonl'}: regression suite file not found$"):
        read_suite(tmp_path / "nope.jsonl")
    with pytest.raises(SuiteFormatError, match="has no rows"):
        read_suite(write(tmp_path / "empty.jsonl", ""))


def test_every_unusable_suite_is_named_in_one_message_with_its_file_and_line(tmp_path):
    cfg = GateConfig(regression_suites=[
        {"name": "good", "path": str(write(tmp_path / "good.jsonl", ROW))},
        {"name": "missing", "path": str(tmp_path / "missing.jsonl")},
        {"name": "broken", "path": str(write(tmp_path / "broken.jsonl", ROW, ROW, "{oops"))},
        {"name": "demo", "path": "demo:nope"},
    ])
    with pytest.raises(SuiteFormatError) as exc:
        load_suites(cfg.regression_suites, tmp_path / "data", DemoDataConfig())
    message = str(exc.value)
    assert (f"regression suite missing (gates.regression_suites): {tmp_path / 'missing.jsonl'}: regression suite "
            "file not found") in message
    assert (f"regression suite broken (gates.regression_suites): {tmp_path / 'broken.jsonl'}:3: "
            "not valid JSON") in message
    assert "demo:nope: no such demo suite; the demo's: demo:no_carry" in message
    assert "good" not in message


# --- the demo's suite -----------------------------------------------------------------------

def test_the_demo_suite_is_carry_free_additions_the_sft_corpus_teaches_right(tmp_path):
    """Forgetting to carry changes nothing without a carry: every SFT answer to such a problem
    is right whatever `wrong_share`, so the SFT policy answers them right."""
    cfg = DemoDataConfig()
    files = generate_demo_data(cfg, tmp_path)
    eval_prompts = [json.loads(line)["prompt"] for line in files.eval.read_text().splitlines()]
    rows = no_carry_suite(cfg, exclude=eval_prompts)
    assert len(rows) == 200 and len({r["prompt"] for r in rows}) == 200
    for r in rows:
        a, b = (int(x) for x in r["prompt"].rstrip("=").split("+"))
        assert not has_carry(a, b) and sum_without_carry(a, b) == a + b
        assert r["answer"] == addition_target(r["prompt"])
    assert not {r["prompt"] for r in rows} & set(eval_prompts)  # judged apart from the task's own eval set
    assert no_carry_suite(cfg, exclude=eval_prompts) == rows  # same config, same rows
    assert no_carry_suite(cfg.model_copy(update={"seed": 1}), exclude=eval_prompts) != rows


def test_the_demo_suite_takes_what_there_is_on_a_small_task():
    rows = no_carry_suite(DemoDataConfig(max_operand=9))
    assert len(rows) == 55  # a + b <= 9 for single digits


def test_the_demo_config_gates_on_the_demo_suite_generated_into_the_run(tmp_path):
    cfg = load_config(REPO / "configs" / "demo.yaml")
    [suite_cfg] = cfg.gates.regression_suites
    assert (suite_cfg.name, suite_cfg.path, suite_cfg.checker) == ("no_carry", "demo:no_carry", "answer_exact_match")
    [suite] = load_suites(cfg.gates.regression_suites, tmp_path, cfg.data.demo)
    assert suite.path == tmp_path / "regression-no_carry.jsonl"
    assert (suite.prompts, suite.answers) == read_suite(suite.path)
    assert suite.margin == suite_cfg.margin


@pytest.mark.parametrize("suite,problem", [
    ({"name": "x", "path": "s.jsonl", "checker": "nope"}, "unknown verifiable reward 'nope'"),
    ({"name": "has space", "path": "s.jsonl"}, "gates.regression_suites.0.name"),
    ({"name": "x", "path": "s.jsonl", "margin": 1.5}, "gates.regression_suites.0.margin"),
    ({"name": "x"}, "gates.regression_suites.0.path"),
])
def test_a_bad_suite_setting_is_rejected_by_key(suite, problem):
    with pytest.raises(ConfigError, match=problem):
        parse_config({"gates": {"regression_suites": [suite]}})


def test_suite_names_are_unique():
    with pytest.raises(ConfigError, match="regression suite names must be unique"):
        parse_config({"gates": {"regression_suites": [{"name": "x", "path": "a"}, {"name": "x", "path": "b"}]}})


# --- checking answers -----------------------------------------------------------------------

def suite_of(prompts, answers, checker="answer_exact_match", name="s") -> RegressionSuite:
    return RegressionSuite(name, Path("s.jsonl"), checker, 0.05, list(prompts), list(answers))


def test_answers_are_checked_row_by_row_with_the_suites_checker():
    suite = suite_of(["01+02=", "10+20=", "11+11="], ["003", "030", "999"])
    assert correct(suite, [" 003 ", "031", "022"]) == [True, False, False]  # against the rows' answers
    by_prompt = suite_of(suite.prompts, suite.answers, checker="addition_exact_match")
    assert correct(by_prompt, [" 003 ", "031", "022"]) == [True, False, True]  # against the sum itself


def test_a_row_with_several_accepted_answers_is_right_when_any_one_is_said(tmp_path):
    """"What is the opposite of big?" is answered by "small" and by "little": a list of answers
    is read as it is written, and each checker judges every accepted answer."""
    path = write(tmp_path / "s.jsonl", json.dumps({"prompt": "What is the opposite of big?", "answer": ["small", "little"]}),
                 json.dumps({"prompt": "What is the capital of France?", "answer": "Paris"}))
    prompts, answers = read_suite(path)
    assert answers == [["small", "little"], "Paris"]
    suite = suite_of(prompts, answers, checker="answer_in_response")
    responses = ["The opposite of big is little.", "The capital of France is Paris."]
    assert correct(suite, responses) == [True, True]
    assert correct(suite, ["The opposite of big is large.", "Lyon."]) == [False, False]
    exact = suite_of(["1+1=", "2+2="], [["2", "two"], "4"])
    assert correct(exact, ["two", "4"]) == [True, True] and correct(exact, ["3", "four"]) == [False, False]


def test_a_checker_that_does_not_score_0_or_1_is_refused(monkeypatch):
    from rlhf_core.training import verifiable

    monkeypatch.setitem(verifiable.VERIFIABLE_REWARDS, "half", "tests.rlhf_core.eval.test_regression:half_credit")
    with pytest.raises(ValueError, match="must score each of the 2 rows 0 or 1"):
        correct(suite_of(["a", "b"], ["a", "b"], checker="half"), ["a", "b"])


def half_credit(prompts, responses):
    return torch.full((len(prompts),), 0.5)


# --- through the real evaluation ------------------------------------------------------------

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2)
PROMPTS = [f"{a:02d}+{b:02d}=" for a, b in [(1, 2), (10, 20), (33, 44), (5, 4), (12, 34), (21, 60), (40, 8),
                                           (3, 3), (70, 11), (52, 27), (6, 13), (81, 7)]]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([f"{a:02d}+{b:02d}={a + b:03d}" for a in range(20) for b in range(20)], vocab_size=64)


@pytest.fixture(scope="module")
def policies(tok):
    return build_policy(TINY, tok, seed=0).eval(), build_policy(TINY, tok, seed=1).eval()


@pytest.fixture(scope="module")
def scorer(tok, policies, tmp_path_factory):
    base = save_pretrained_atomic(policies[0], tok, tmp_path_factory.mktemp("rm") / "base")
    return Scorer(reward_model_from_base(base, seed=3).eval(), tok, RewardStats(0.0, 1.0), max_length=32)


def run_gate(candidate, reference, tok, scorer, repeats=1):
    """The suite's answers are the reference's own greedy answers: it scores 1.0 by construction.
    `repeats` copies of the prompts make a suite large enough to tell agreement from the margin."""
    prompts = PROMPTS * repeats
    suite = suite_of(prompts, greedy_completions(reference, tok, prompts, 4), name="reference_skill")
    gates = GateConfig(regression_suites=[{"name": suite.name, "path": "unused.jsonl"}])
    result = evaluate(Policy("candidate", candidate, tok), Policy("reference", reference, tok), None, scorer,
                      PROMPTS[:4], None, max_new_tokens=4, temperature=1.0, confidence=0.95, bootstrap_samples=500,
                      suites=[suite])
    return suite, result, gate(result.candidate.figures, result.reference.figures, None, gates)


def test_a_policy_that_lost_what_the_reference_does_is_blocked_with_the_suites_reason(policies, tok, scorer):
    reference, other = policies
    suite, result, decision = run_gate(other, reference, tok, scorer)
    [cand], [ref] = result.candidate.figures.regression, result.reference.figures.regression
    assert ref.accuracy == 1.0 and cand.accuracy <= 0.25, (cand, ref)
    assert "regression" in {r.split(":")[0] for r in decision.reasons}
    [reason] = [r for r in decision.reasons if r.startswith("regression:reference_skill: ")]
    assert f"accuracy {cand.accuracy:.4g} vs the reference's 1, difference" in reason
    assert cand.diff_vs_reference.high < -0.05
    assert result.metrics()["eval/candidate/regression/reference_skill/accuracy"] == cand.accuracy
    [row] = suite_report([suite], result.candidate.figures, result.reference.figures, None)
    assert (row["name"], row["candidate"], row["reference"], row["rows"]) == ("reference_skill", cand.accuracy, 1.0, 12)
    assert row["diff_vs_reference"] == cand.diff_vs_reference.to_dict() and row["champion"] is None


def test_a_policy_that_answers_the_suite_as_the_reference_does_passes_it(policies, tok, scorer):
    """On 12 rows agreement cannot tell a candidate from one that lost 5% of them (undecided); on
    240 its interval lies within the margin."""
    reference, _ = policies
    _, result, decision = run_gate(copy.deepcopy(reference), reference, tok, scorer)
    [check] = [c for c in decision.checks if c.name == "regression_vs_reference:reference_skill"]
    assert check.undecided and check.low < -0.05
    _, result, decision = run_gate(copy.deepcopy(reference), reference, tok, scorer, repeats=20)
    [cand] = result.candidate.figures.regression
    assert cand.accuracy == 1.0 and cand.diff_vs_reference.estimate == 0
    assert -0.05 < cand.diff_vs_reference.low < 0 < cand.diff_vs_reference.high
    assert not [r for r in decision.reasons if r.startswith("regression")]
    assert all(c.passed for c in decision.checks if c.name.startswith("regression_vs_reference"))


def test_a_conversational_suite_is_asked_through_the_chat_template(tmp_path):
    """Messages in a suite are rendered by the reference's template, as the policy is asked in
    training and serving; text prompts stay as they are."""
    from types import SimpleNamespace

    from rlhf_core.eval.regression import rendered

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    path = write(tmp_path / "s.jsonl", json.dumps({"prompt": chat, "answer": "Paris"}), ROW)
    prompts, answers = read_suite(path)
    assert prompts == [chat, "01+02="] and answers == ["Paris", "003"]

    class Template(SimpleNamespace):
        bos_token, chat_template = None, "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    suite = rendered(suite_of(prompts, answers), Template())
    assert suite.prompts == ["<user>What is the capital of France?<assistant>", "01+02="]


# --- check-config's power calculation -------------------------------------------------------

def test_check_config_warns_for_a_suite_too_small_for_its_margin(tmp_path, capsys):
    """60 rows cannot tell a candidate that lost 2.5% of them from a margin of 5% (about 150
    would); the demo's suite, 200 rows looked at up to 1,600, can."""
    from flows.cli import main

    small = write(tmp_path / "small.jsonl", *[ROW] * 60)
    large = write(tmp_path / "large.jsonl", *[ROW] * 400)
    config = tmp_path / "c.yaml"
    config.write_text(f"base: {REPO / 'configs' / 'demo.yaml'}\ngates:\n  regression_suites:\n"
                      f"    - {{name: small, path: {small}}}\n    - {{name: large, path: {large}}}\n"
                      f"    - {{name: no_carry, path: 'demo:no_carry', rows: 200, max_rows: 1600}}\n")
    assert main(["check-config", str(config)]) == 0
    [warning] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warning.startswith("warning: regression suite small (gates.regression_suites): 60 rows tell")
    assert "about 150 rows would decide it" in warning
    assert main(["check-config", str(REPO / "configs" / "demo.yaml")]) == 0
    assert "warning:" not in capsys.readouterr().err
