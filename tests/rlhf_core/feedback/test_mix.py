"""Base preference data plus feedback datasets: recency, weights, formats."""
import json

import pytest

from rlhf_core.feedback.mix import FeedbackMixError, labelled_answers, mix, recent_exports

DAY = 86400.0


def export(root, version, created_at, pairs, served=("1",)):
    d = root / version
    d.mkdir(parents=True)
    (d / "preferences.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (d / "manifest.json").write_text(json.dumps({"version": version, "created_at": created_at, "fingerprint": "f",
                                                 "served_versions": {v: 1 for v in served}, "pairs": len(pairs)}))
    return d


PAIR = {"prompt": "12+34=", "chosen": "046", "rejected": "036", "source": "choice", "response_id": "r",
        "model_version": "1"}


def test_recent_exports_keep_the_window_oldest_first_and_skip_unfinished_ones(tmp_path):
    now = 100 * DAY
    export(tmp_path, "feedback-b", now - 2 * DAY, [PAIR], served=("2", "1"))
    export(tmp_path, "feedback-a", now - 5 * DAY, [PAIR])
    export(tmp_path, "feedback-old", now - 40 * DAY, [PAIR])
    (tmp_path / ".feedback-c.tmp").mkdir()  # an export being written
    found = recent_exports(tmp_path, 30, now=now)
    assert [e.version for e in found] == ["feedback-a", "feedback-b"]
    assert found[1].served_versions == ("1", "2")
    assert len(recent_exports(tmp_path, None, now=now)) == 3
    assert recent_exports(tmp_path / "none", 30) == []


def test_mix_appends_feedback_pairs_in_the_base_columns(tmp_path):
    base = [{"id": "pair-0", "prompt": "1+1=", "chosen": "02", "rejected": "03", "source": "demo"}]
    export(tmp_path, "feedback-a", 0.0, [PAIR, PAIR | {"chosen": "047"}])
    mixed = mix(base, recent_exports(tmp_path, None), weight=1.0)
    assert mixed.taken == {"feedback-a": 2} and mixed.rows[0] == base[0] and mixed.already_present == 0
    assert mixed.rows[1] == {"id": "feedback-a-000000", "prompt": "12+34=", "chosen": "046", "rejected": "036",
                             "source": "feedback:feedback-a"}
    mixed = mix([{"prompt": "1+1=", "chosen": "02", "rejected": "03"}], recent_exports(tmp_path, None), 1.0)
    assert set(mixed.rows[1]) == {"prompt", "chosen", "rejected"}


def test_a_pair_already_in_the_base_data_or_an_earlier_export_is_left_out_and_counted(tmp_path):
    base = [{"prompt": "12+34=", "chosen": "046", "rejected": "036"}]
    export(tmp_path, "feedback-a", 0.0, [PAIR, PAIR | {"rejected": "045"}, PAIR | {"rejected": "045"}])
    export(tmp_path, "feedback-b", 1.0, [PAIR | {"rejected": "045"}, PAIR | {"rejected": "044"}])
    mixed = mix(base, recent_exports(tmp_path, None), 1.0)
    assert mixed.taken == {"feedback-a": 1, "feedback-b": 1} and mixed.already_present == 3
    triples = [(r["prompt"], r["chosen"], r["rejected"]) for r in mixed.rows]
    assert len(triples) == len(set(triples)) == 3


@pytest.mark.parametrize("weight", [-0.5, 1.5, 2.0])
def test_a_weight_outside_zero_to_one_is_refused(tmp_path, weight):
    export(tmp_path, "feedback-a", 0.0, [PAIR])
    with pytest.raises(ValueError, match="between 0 and 1"):
        mix([], recent_exports(tmp_path, None), weight)


def test_a_fractional_weight_samples_that_share_and_is_seeded(tmp_path):
    export(tmp_path, "feedback-a", 0.0, [PAIR | {"rejected": f"{i:04d}"} for i in range(2000)])
    exports = recent_exports(tmp_path, None)
    taken = mix([], exports, 0.25, seed=1).taken
    assert abs(taken["feedback-a"] - 500) < 4 * (2000 * 0.25 * 0.75) ** 0.5  # binomial: within 4 sd
    assert mix([], exports, 0.25, seed=1) == mix([], exports, 0.25, seed=1)
    assert mix([], exports, 0.0).taken == {"feedback-a": 0}


def test_feedback_in_another_format_than_the_base_is_refused_naming_the_file(tmp_path):
    chat = {"prompt": [{"role": "user", "content": "12+34="}], "chosen": [{"role": "assistant", "content": "046"}],
            "rejected": [{"role": "assistant", "content": "036"}]}
    export(tmp_path, "feedback-a", 0.0, [chat])
    with pytest.raises(FeedbackMixError, match=r"feedback-a/preferences.jsonl line 1: a conversational pair, "
                                               r"but base.jsonl is standard"):
        mix([{"prompt": "1+1=", "chosen": "02", "rejected": "03"}], recent_exports(tmp_path, None), 1.0,
            where="base.jsonl")


def rated(root, version, created_at, answers):
    """An export whose ratings.jsonl holds `answers` (prompt, completion, label) and no pairs."""
    d = export(root, version, created_at, [])
    (d / "ratings.jsonl").write_text("".join(json.dumps({"response_id": "r", "model_version": "1", "score": None, **a})
                                             + "\n" for a in answers))
    return d


UP = {"prompt": "12+34=", "completion": "046", "label": True}
DOWN = {"prompt": "12+34=", "completion": "036", "label": False}


def test_labelled_answers_take_each_rated_answer_once_with_its_label(tmp_path):
    rated(tmp_path, "feedback-a", 0.0, [UP, UP, DOWN])  # two users rated 046 up
    rated(tmp_path, "feedback-b", 1.0, [UP, DOWN | {"prompt": "1+1=", "completion": "03"},
                                        DOWN | {"completion": "  "}])  # nothing to learn from
    got = labelled_answers(recent_exports(tmp_path, None), 1.0)
    assert got.rows == [
        {"prompt": "12+34=", "completion": "046", "desirable": True, "source": "feedback:feedback-a"},
        {"prompt": "12+34=", "completion": "036", "desirable": False, "source": "feedback:feedback-a"},
        {"prompt": "1+1=", "completion": "03", "desirable": False, "source": "feedback:feedback-b"}]
    assert got.taken == {"feedback-a": 2, "feedback-b": 1} and got.contradictory == 0 and got.blank == 1
    export(tmp_path / "none", "feedback-c", 0.0, [PAIR])  # an export without ratings.jsonl has none
    assert labelled_answers(recent_exports(tmp_path / "none", None), 1.0).rows == []


def test_an_answer_rated_up_in_one_export_and_down_in_another_is_left_out(tmp_path):
    rated(tmp_path, "feedback-a", 0.0, [UP, DOWN])
    rated(tmp_path, "feedback-b", 1.0, [UP | {"label": False}])
    got = labelled_answers(recent_exports(tmp_path, None), 1.0)
    assert [r["completion"] for r in got.rows] == ["036"] and got.contradictory == 1
    assert got.taken == {"feedback-a": 1, "feedback-b": 0}


def test_labelled_answers_sample_the_weight_share_and_refuse_bad_rows_by_line(tmp_path):
    rated(tmp_path, "feedback-a", 0.0, [UP | {"completion": f"{i:04d}"} for i in range(2000)])
    exports = recent_exports(tmp_path, None)
    taken = labelled_answers(exports, 0.25, seed=1).taken["feedback-a"]
    assert abs(taken - 500) < 4 * (2000 * 0.25 * 0.75) ** 0.5
    assert labelled_answers(exports, 0.25, seed=1) == labelled_answers(exports, 0.25, seed=1)
    with pytest.raises(ValueError, match="between 0 and 1"):
        labelled_answers(exports, 1.5)
    rated(tmp_path / "bad", "feedback-b", 0.0, [UP, UP | {"label": "up"}])
    with pytest.raises(FeedbackMixError, match=r"feedback-b/ratings.jsonl line 2: 'label' is 'up', not true or false"):
        labelled_answers(recent_exports(tmp_path / "bad", None), 1.0)
    chat = {"prompt": [{"role": "user", "content": "12+34="}], "completion": [{"role": "assistant", "content": "046"}],
            "label": True}
    rated(tmp_path / "chat", "feedback-c", 0.0, [chat])
    with pytest.raises(FeedbackMixError, match=r"feedback-c/ratings.jsonl line 1: a conversational answer, but "
                                               r"base.jsonl is standard"):
        labelled_answers(recent_exports(tmp_path / "chat", None), 1.0, base_format="standard", where="base.jsonl")
