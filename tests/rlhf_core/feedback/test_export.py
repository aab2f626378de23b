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


def test_a_flooding_user_keeps_the_capped_share_and_is_named():
    many = [rating(f"f{i}", "flood", f"{i:03d}", 1, prompt=f"{i}+0=") for i in range(300)]
    few = [rating(f"c{i}", f"calm{i}", "1", 1, prompt=f"c{i}") for i in range(200)]
    ds = build_dataset(many + few, [], max_user_share=0.2, min_user_flood=20)
    # at most 0.2 of what is kept: 0.2 / 0.8 x 200 others = 50 of the 300, the first 50
    assert ds.capped_users == {"flood": 250} and ds.dropped == {"user_cap": 250} and len(ds.ratings) == 250
    kept = [r["completion"] for r in ds.ratings if r["completion"] != "1"]
    assert kept == [f"{i:03d}" for i in range(50)] and 50 / 250 == 0.2
    # min_user_flood items are never cut: the same share of a small window is not a flood
    assert build_dataset(many[:5] + few[:2], [], max_user_share=0.2, min_user_flood=20).dropped == {}
    assert len(build_dataset(many[:30] + few[:10], [], max_user_share=0.2, min_user_flood=20).ratings) == 30


def test_a_users_repeated_judgement_counts_once_and_a_burst_is_cut_to_the_rate():
    again = [rating("r1", "u1", "046", 1), rating("r2", "u1", "046", 1), rating("r3", "u2", "046", 1)]
    ds = build_dataset(again, [choice("c1", "u1", ["1", "2"], 0, prompt="p"), choice("c2", "u1", ["2", "1"], 1, prompt="p")])
    assert ds.dropped == {"duplicate": 2} and len(ds.ratings) == 2 and len(ds.pairs) == 1
    # 30 thumbs in 3 seconds from one user, 5 from another over 5 minutes: 20 a minute pass
    fast = [rating(f"b{i}", "bot", f"{i}", 1, prompt=f"{i}+1=") | {"updated_at": 1000 + i / 10} for i in range(30)]
    slow = [rating(f"s{i}", "slow", f"{i}", -1, prompt=f"{i}+2=") | {"updated_at": 1000 + 60 * i} for i in range(5)]
    ds = build_dataset(fast + slow, [], max_burst=20, burst_window_s=60, min_user_flood=100)
    assert ds.dropped == {"burst": 10} and len(ds.ratings) == 25


def test_an_export_with_a_flood_duplicates_and_a_length_biased_rater_keeps_the_capped_share_and_reports_each_drop():
    """One window as a gateway sees it: 40 calm users, one who floods, one who rates twice, one
    who always picks the longest answer; the report names each drop and the biased rater."""
    calm = [rating(f"c{i}", f"calm{i % 40}", f"{i:02d}", 1 if i % 2 else -1, prompt=f"{i % 20}+1=") for i in range(80)]
    flood = [rating(f"f{i}", "flood", f"{i:03d}", 1, prompt=f"{i}+9=") for i in range(100)]
    twice = [rating("t1", "twice", "77", 1, prompt="7+7="), rating("t2", "twice", "77", 1, prompt="7+7=")]
    longest = [choice(f"l{i}", "long", [f"{i}", f"{i}{i}{i}"], 1, prompt=f"{i}*2=") for i in range(12)]
    ds = build_dataset(calm + flood + twice, longest, max_user_share=0.2, min_user_flood=20)
    others = 80 + 1 + 12
    assert ds.capped_users == {"flood": 100 - int(0.25 * others)} and ds.dropped["duplicate"] == 1
    kept_flood = sum(r["completion"].startswith("0") and len(r["completion"]) == 3 for r in ds.ratings)
    assert kept_flood == int(0.25 * others) and kept_flood / (kept_flood + others) <= 0.2
    q = ds.quality
    assert q["length_biased_raters"] == {"long": 1.0} and q["position"]["first_preferred_share"] == 0.0
    assert q["position"]["chance_share"] == 0.5
    report = "\n".join(ds.report())
    for expected in ("dropped 1: duplicate", f"dropped {100 - int(0.25 * others)}: user_cap",
                     "capped users: flood", "chose the longest answer almost always: long (1.0)"):
        assert expected in report, report


def test_agreement_between_users_on_repeated_answers_is_measured():
    ratings = [rating("a1", "u1", "046", 1), rating("a2", "u2", "046", 1), rating("a3", "u3", "046", -1),
               rating("b1", "u1", "99", 1, prompt="1+1="), rating("b2", "u2", "99", 1, prompt="1+1=")]
    agree = build_dataset(ratings, []).quality["agreement"]["thumbs"]
    # "046": u1-u2 agree, u1-u3 and u2-u3 do not (the answer is then dropped as contradictory); "99": they agree
    assert agree == {"items": 2, "user_pairs": 4, "agree_share": 0.5}


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
