"""Held-out accuracy judges an answer by the exact text, or by `data.answer_checker`."""
from __future__ import annotations

import pytest

from rlhf_core.eval.accuracy import answer_accuracy
from rlhf_core.training.verifiable import answer_in_response, check_answers, last_number, last_number_match


@pytest.mark.parametrize(("text", "number"), [
    ("12 + 34 = 46.", "46"), ("The answer is 46", "46"), ("46, or maybe 47", "47"), ("no number", None),
    ("It comes to 1,046.", "1046"), ("-3 plus 5 is 2.5", "2.5"), ("1,000,000 dollars", "1000000"),
])
def test_the_last_number_is_read_as_written(text, number):
    assert last_number(text) == number


def test_last_number_match_reads_the_answer_in_a_sentence_and_refuses_a_row_without_one():
    got = last_number_match(["q"] * 4, ["12 + 34 = 46.", "I think 46.0", "46 or 47", "forty-six"], ["46"] * 4)
    assert got.tolist() == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="no numeric answer"):
        last_number_match(["q"], ["46"], ["forty-six"])


def test_without_a_checker_the_text_must_be_the_answer():
    assert check_answers(["a", "b"], [" 046\n", "46"], ["046", "046"]) == [True, False]
    assert answer_accuracy(["a", "b"], [" 046\n", "46"], ["046", "046"]) == 0.5


def test_a_checker_by_name_or_path_judges_and_a_bad_score_is_named():
    prompts, said, answers = ["a", "b", "c"], ["So it is 46.", "46", "It is 45."], ["46", "46", "46"]
    assert check_answers(prompts, said, answers, "last_number_match") == [True, True, False]
    assert answer_accuracy(prompts, said, answers, "rlhf_core.training.verifiable:last_number_match") == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match=r"data.answer_checker: checker .*:half must score each of the 3 rows 0 or 1"):
        check_answers(prompts, said, answers, f"{__name__}:half")
    with pytest.raises(ValueError, match="3 prompts, 2 predictions"):
        check_answers(prompts, said[:2], answers)


def half(prompts, responses):
    return [0.5] * len(responses)


def test_answer_in_response_wants_the_whole_words_in_any_case():
    said = ["The capital of France is Paris.", "Parisian food", "It is New\n Delhi.", "paris, of course"]
    assert answer_in_response(["q"] * 4, said, ["Paris", "Paris", "new delhi", "Paris"]).tolist() == [1.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="no answer"):
        answer_in_response(["q"], ["x"], ["  "])
