"""Base preference data plus feedback datasets: recency, weights, formats."""
import json

import pytest

from rlhf_core.feedback.mix import FeedbackMixError, mix, recent_exports

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
    rows, taken = mix(base, recent_exports(tmp_path, None), weight=1.0)
    assert taken == {"feedback-a": 2} and rows[0] == base[0]
    assert rows[1] == {"id": "feedback-a-000000-0", "prompt": "12+34=", "chosen": "046", "rejected": "036",
                       "source": "feedback:feedback-a"}
    rows, _ = mix([{"prompt": "1+1=", "chosen": "02", "rejected": "03"}], recent_exports(tmp_path, None), 1.0)
    assert set(rows[1]) == {"prompt", "chosen", "rejected"}


@pytest.mark.parametrize("weight, expected", [(0.0, 0), (2.0, 200), (3.0, 300)])
def test_whole_weights_repeat_each_pair(tmp_path, weight, expected):
    export(tmp_path, "feedback-a", 0.0, [PAIR] * 100)
    _, taken = mix([], recent_exports(tmp_path, None), weight)
    assert taken == {"feedback-a": expected}


def test_a_fractional_weight_samples_that_share_and_is_seeded(tmp_path):
    export(tmp_path, "feedback-a", 0.0, [PAIR] * 2000)
    exports = recent_exports(tmp_path, None)
    _, taken = mix([], exports, 0.25, seed=1)
    assert abs(taken["feedback-a"] - 500) < 4 * (2000 * 0.25 * 0.75) ** 0.5  # binomial: within 4 sd
    assert mix([], exports, 0.25, seed=1) == mix([], exports, 0.25, seed=1)


def test_feedback_in_another_format_than_the_base_is_refused_naming_the_file(tmp_path):
    chat = {"prompt": [{"role": "user", "content": "12+34="}], "chosen": [{"role": "assistant", "content": "046"}],
            "rejected": [{"role": "assistant", "content": "036"}]}
    export(tmp_path, "feedback-a", 0.0, [chat])
    with pytest.raises(FeedbackMixError, match=r"feedback-a/preferences.jsonl line 1: a conversational pair, "
                                               r"but base.jsonl is standard"):
        mix([{"prompt": "1+1=", "chosen": "02", "rejected": "03"}], recent_exports(tmp_path, None), 1.0,
            where="base.jsonl")
