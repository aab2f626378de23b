"""The suite builder's rule: a question stays when the model is right greedily and in most of its
samples. (The engine side runs in the chat-model bench; here the rule and its bad input.)"""
import pytest

from rlhf_core.eval.suite_builder import build_suite, robust


def test_a_question_stays_only_when_right_greedily_and_in_enough_samples():
    greedy = [True, True, False, True]
    sampled = [[True] * 8, [True] * 6 + [False] * 2, [True] * 8, [True] * 7 + [False]]
    assert robust(greedy, sampled, min_right=7) == [True, False, False, True]
    assert robust(greedy, sampled, min_right=6) == [True, True, False, True]


def test_mismatched_counts_are_refused():
    with pytest.raises(ValueError, match="2 greedy answers for 1 sampled"):
        robust([True, True], [[True]], min_right=1)


def test_min_right_beyond_the_samples_is_refused_before_any_model_loads(tmp_path):
    with pytest.raises(ValueError, match="--min-right must be between 1 and --samples \\(8\\), got 9"):
        build_suite(tmp_path / "q.jsonl", tmp_path / "no-model", tmp_path / "out.jsonl", min_right=9)
