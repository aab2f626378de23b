import math

import pytest
import torch

from rlhf_core.eval.metrics import degenerate_rate, is_degenerate, response_length_stats, win_rate


def test_length_stats_in_characters_closed_form():
    stats = response_length_stats(["a" * n for n in range(1, 11)])  # lengths 1..10
    assert stats == {"mean": 5.5, "p50": 5.5, "p90": pytest.approx(9.1), "max": 10.0}


def test_length_stats_of_one_response():
    assert response_length_stats(["055"]) == {"mean": 3.0, "p50": 3.0, "p90": 3.0, "max": 3.0}


class WordTokenizer:
    """Stands in for a Hugging Face tokenizer: one token per word, `<s>` unless told otherwise."""

    def encode(self, text, add_special_tokens=True):
        return (["<s>"] if add_special_tokens else []) + text.split()


def test_length_stats_in_tokens_exclude_special_tokens():
    stats = response_length_stats(["one", "one two three", "a b c d e"], tokenizer=WordTokenizer())
    assert stats == {"mean": 3.0, "p50": 3.0, "p90": pytest.approx(4.6), "max": 5.0}


def test_length_stats_need_responses():
    with pytest.raises(ValueError, match="no responses"):
        response_length_stats([])


@pytest.mark.parametrize(
    "response",
    [
        pytest.param("", id="empty"),
        pytest.param(" \n\t ", id="whitespace-only"),
        pytest.param("055055055", id="char-loop-without-spaces"),
        pytest.param("hello hello hello", id="word-loop"),
        pytest.param("I am fine. I am fine. I am fine.", id="phrase-loop"),
        pytest.param("ok: the the the the the the", id="loop-covers-most-words"),
        pytest.param("aaaaaa", id="six-identical-chars"),
    ],
)
def test_degenerate_examples(response):
    assert is_degenerate(response)


@pytest.mark.parametrize(
    "response",
    [
        pytest.param("055", id="short-answer"),
        pytest.param("000", id="zeros-are-an-answer"),
        pytest.param("10000", id="number-with-zeros"),
        pytest.param("hello hello", id="only-two-copies"),
        pytest.param("The answer is 42, because 40 plus 2 is 42.", id="prose"),
        pytest.param("abcabcabc and then a much longer tail of ordinary text follows", id="loop-covers-too-little"),
    ],
)
def test_degenerate_non_examples(response):
    assert not is_degenerate(response)


def test_degenerate_thresholds_are_parameters():
    assert not is_degenerate("hello hello hello", min_repeats=4)
    assert is_degenerate("hello hello", min_repeats=2)
    text = "x y x y x y z z z z"  # 6 of 10 words in the longest loop
    assert is_degenerate(text, min_coverage=0.6) and not is_degenerate(text, min_coverage=0.7)


def test_degenerate_rate_is_the_share():
    assert degenerate_rate(["", "055", "hello hello hello", "The answer is 42."]) == 0.5
    with pytest.raises(ValueError, match="no responses"):
        degenerate_rate([])


@pytest.mark.parametrize(
    "cand,base,expected",
    [
        pytest.param([1.0, 2.0, 3.0], [0.0, 0.0, 0.0], 1.0, id="all-wins"),
        pytest.param([0.0, 0.0], [1.0, 1.0], 0.0, id="all-losses"),
        pytest.param([1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], 0.5, id="all-ties"),
        pytest.param([2.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 5.0], 0.375, id="win-loss-tie-loss"),
    ],
)
def test_win_rate_closed_cases(cand, base, expected):
    assert win_rate(cand, base) == expected


def test_win_rate_accepts_tensors():
    assert win_rate(torch.tensor([1.0, 2.0]), torch.tensor([2.0, 2.0])) == 0.25


def test_win_rate_is_symmetric():
    cand, base = [0.3, 1.2, -0.5, 0.0, 0.0], [0.1, 1.5, -0.5, 0.2, 0.0]
    assert win_rate(cand, base) + win_rate(base, cand) == 1.0


@pytest.mark.parametrize(
    "cand,base,match",
    [
        ([1.0], [1.0, 2.0], "1 candidate scores for 2"),
        ([], [], "no scores"),
        ([math.nan], [0.0], "NaN"),
    ],
)
def test_win_rate_rejects_bad_input(cand, base, match):
    with pytest.raises(ValueError, match=match):
        win_rate(cand, base)
