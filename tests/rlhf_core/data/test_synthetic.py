import json

import pytest

from rlhf_core.config import DemoDataConfig
from rlhf_core.data.synthetic import generate_demo_data, has_carry, sum_without_carry

SMALL = DemoDataConfig(seed=3, n_sft=300, n_pairs=200, n_eval=50)


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_same_seed_same_bytes(tmp_path):
    a, b = generate_demo_data(SMALL, tmp_path / "a"), generate_demo_data(SMALL, tmp_path / "b")
    for x, y in [(a.sft, b.sft), (a.preferences, b.preferences), (a.eval, b.eval)]:
        assert x.read_bytes() == y.read_bytes()


def test_other_seed_other_data(tmp_path):
    a = generate_demo_data(SMALL, tmp_path / "a")
    b = generate_demo_data(SMALL.model_copy(update={"seed": 4}), tmp_path / "b")
    assert a.preferences.read_bytes() != b.preferences.read_bytes()


def test_eval_prompts_appear_in_no_training_split(tmp_path):
    files = generate_demo_data(SMALL, tmp_path)
    eval_prompts = {r["prompt"] for r in read(files.eval)}
    train_prompts = {r["prompt"] for r in read(files.sft)} | {r["prompt"] for r in read(files.preferences)}
    assert len(eval_prompts) == SMALL.n_eval
    assert not eval_prompts & train_prompts


def test_pairs_prefer_the_correct_sum(tmp_path):
    for row in read(generate_demo_data(SMALL, tmp_path).preferences):
        a, b = map(int, row["prompt"].removesuffix("=").split("+"))
        assert int(row["chosen"]) == a + b != int(row["rejected"])


@pytest.mark.parametrize("share", [0.0, 0.6, 1.0])
def test_sft_wrong_answers_are_the_no_carry_mistake_at_the_configured_share(tmp_path, share):
    cfg = DemoDataConfig(seed=1, n_sft=2000, n_pairs=10, n_eval=10, wrong_share=share)
    rows = read(generate_demo_data(cfg, tmp_path).sft)
    carry_rows = [r for r in rows if has_carry(*map(int, r["prompt"].removesuffix("=").split("+")))]
    wrong = 0
    for r in carry_rows:
        a, b = map(int, r["prompt"].removesuffix("=").split("+"))
        assert int(r["completion"]) in (a + b, sum_without_carry(a, b))
        wrong += int(r["completion"]) != a + b
    assert wrong / len(carry_rows) == pytest.approx(share, abs=0.04)


def test_no_carry_sum_closed_cases():
    assert sum_without_carry(27, 15) == 32
    assert sum_without_carry(99, 1) == 90
    assert sum_without_carry(12, 34) == 46 and not has_carry(12, 34)


def test_asking_for_more_problems_than_exist_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="exceeds the 100 distinct problems"):
        generate_demo_data(DemoDataConfig(max_operand=9, n_sft=95, n_pairs=10, n_eval=10), tmp_path)


def test_pairs_mirror_the_policy_failure_modes_at_the_configured_near_miss_share(tmp_path):
    cfg = DemoDataConfig(seed=2, n_sft=10, n_pairs=1000, n_eval=10, near_miss_share=0.2)
    rows = read(generate_demo_data(cfg, tmp_path).preferences)
    near = spurious = 0
    for r in rows:
        a, b = map(int, r["prompt"].removesuffix("=").split("+"))
        if has_carry(a, b):
            assert int(r["rejected"]) == sum_without_carry(a, b)
        else:
            assert int(r["rejected"]) - (a + b) in (-10, -1, 1, 10, 100)  # 100: a carry where none is
            near += 1
            spurious += int(r["rejected"]) - (a + b) == 100
    assert near == 200 and 70 <= spurious <= 130  # half of the near misses, as often as not


def test_the_demos_own_settings_are_refused_on_data_that_is_not_the_demos_naming_each():
    from rlhf_core.data.demo_task import demo_settings_misfit

    chat = ["What is seven plus five?", "Name a prime above 10."]
    misfit = demo_settings_misfit("addition_exact_match", ["demo:no_carry", "suites/mine.jsonl"], chat, "my/prefs.jsonl")
    assert len(misfit) == 2
    assert misfit[0].startswith("policy.verifiable_reward: addition_exact_match checks the demo's sums")
    assert "2 of the 2 prompts of my/prefs.jsonl are not the demo's additions" in misfit[0]
    assert misfit[1].startswith("gates.regression_suites: demo:no_carry is the demo's arithmetic")
    # the demo's own files (`rlhf make-demo-data`) given as data are still the demo's task
    assert demo_settings_misfit("addition_exact_match", ["demo:no_carry"], ["07+48=", "12+34="], "demo.jsonl") == []
    conversation = [[{"role": "system", "content": "Add."}, {"role": "user", "content": "07+48="}]]
    assert demo_settings_misfit("addition_exact_match", [], conversation, "chat.jsonl") == []  # the same task, as a chat
    assert demo_settings_misfit(None, ["suites/mine.jsonl"], chat, "my/prefs.jsonl") == []
