"""Feedback to preference data: each filter and each way of pairing, on hand-built windows."""
from rlhf_core.feedback.export import build_dataset, text_view


def rating(rid, user, text, thumb, prompt="12+34=", version="1", kind="completion", score=None):
    return {"response_id": rid, "user_hash": user, "text": text, "thumb": thumb, "score": score, "prompt": prompt,
            "model_version": version, "kind": kind, "choice_index": 0}


def choice(rid, user, answers, preferred, prompt="12+34=", version="1", kind="completion"):
    return {"response_id": rid, "user_hash": user, "answers": list(answers), "preferred_index": preferred,
            "prompt": prompt, "model_version": version, "kind": kind}


def test_a_choice_pairs_the_preferred_answer_with_each_other_answer():
    ds = build_dataset([], [choice("r1", "u1", ["046", "036", "047"], 0)])
    assert [(p["chosen"], p["rejected"], p["source"]) for p in ds.pairs] == [("046", "036", "choice"),
                                                                             ("046", "047", "choice")]
    assert ds.ratings == [] and ds.dropped == {} and ds.versions == {"1": 1}


def test_answers_rated_up_and_down_on_one_prompt_make_pairs_and_every_thumb_is_an_example():
    ds = build_dataset([rating("r1", "u1", "046", 1), rating("r2", "u2", "036", -1),
                        rating("r3", "u3", "99", 1, prompt="1+1=")], [])
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in ds.pairs] == [("12+34=", "046", "036")]
    assert [(r["completion"], r["label"]) for r in ds.ratings] == [("046", True), ("036", False), ("99", True)]
    assert ds.users == 3


def test_pairs_per_prompt_are_capped():
    ups = [rating(f"u{i}", f"a{i}", f"1{i}", 1) for i in range(3)]
    downs = [rating(f"d{i}", f"b{i}", f"2{i}", -1) for i in range(3)]
    assert len(build_dataset(ups + downs, [], max_pairs_per_prompt=4).pairs) == 4
    assert len(build_dataset(ups + downs, [], max_pairs_per_prompt=100).pairs) == 9


def test_feedback_on_a_rolled_back_version_is_dropped_and_counted():
    ds = build_dataset([rating("r1", "u1", "046", 1, version="2"), rating("r2", "u2", "036", -1, version="1")],
                       [choice("r3", "u3", ["1", "2"], 0, version="2")], rolled_back={"2"})
    assert ds.dropped == {"rolled_back_version": 2} and ds.versions == {"1": 1} and ds.pairs == []


def test_a_flooding_user_is_dropped_whole_and_named():
    many = [rating(f"f{i}", "flood", f"{i:03d}", 1, prompt=f"{i}+0=") for i in range(30)]
    few = [rating(f"c{i}", f"calm{i}", "1", 1, prompt=f"c{i}") for i in range(10)]
    ds = build_dataset(many + few, [], max_user_share=0.2, min_user_flood=20)
    assert ds.flood_users == ["flood"] and ds.dropped == {"flood_user": 30} and len(ds.ratings) == 10
    # the same share under min_user_flood items is a small window, not a flood
    assert build_dataset(many[:5] + few[:2], [], max_user_share=0.2, min_user_flood=20).dropped == {}


def test_contradictory_ratings_and_choices_are_dropped():
    ds = build_dataset([rating("r1", "u1", "046", 1), rating("r2", "u2", "046", -1), rating("r3", "u3", "036", -1)],
                       [choice("c1", "u1", ["1", "2"], 0, prompt="p"), choice("c2", "u2", ["2", "1"], 0, prompt="p")])
    assert ds.dropped == {"contradictory": 4}
    assert ds.pairs == [] and [r["completion"] for r in ds.ratings] == ["036"]


def test_identical_answers_never_make_a_pair():
    ds = build_dataset([], [choice("r1", "u1", ["046", "046"], 1)])
    assert ds.pairs == [] and ds.dropped == {"identical_answers": 1}


def test_chat_feedback_keeps_the_conversational_format():
    messages = [{"role": "user", "content": "12+34="}]
    ds = build_dataset([rating("r1", "u1", "046", 1, prompt=messages, kind="chat"),
                        rating("r2", "u2", "036", -1, prompt=messages, kind="chat")], [])
    [pair] = ds.pairs
    assert pair["prompt"] == messages and pair["chosen"] == [{"role": "assistant", "content": "046"}]
    assert text_view(pair) == {"prompt": "12+34=", "chosen": "046", "rejected": "036"}


def test_score_only_feedback_is_not_exported_and_the_fingerprint_follows_the_rows():
    a = build_dataset([rating("r1", "u1", "046", None, score=0.8), rating("r2", "u2", "036", -1)], [])
    assert a.dropped == {"score_only": 1} and len(a.ratings) == 1
    b = build_dataset([rating("r2", "u2", "036", -1)], [])
    c = build_dataset([rating("r2", "u2", "037", -1)], [])
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
