"""Preference rounds: annotators (simulated, judge replies, the people's queue), the data
contract on new pairs, and the reward model's continued training on them."""
import json

import httpx
import pytest
import torch

from rlhf_core.config import JudgeConfig, ModelConfig, RoundsConfig, ValidationConfig
from rlhf_core.models.llama import build_policy, save_pretrained_atomic
from rlhf_core.models.reward import member_mean, reward_model_from_base, score_members
from rlhf_core.tokenizer import load_tokenizer, train_tokenizer
from rlhf_core.training.preference_rounds import (
    Item,
    JudgeAnnotator,
    QueueAnnotator,
    SimulatedAnnotator,
    contract_filter,
    identical_items,
    make_annotator,
    parse_match_answer,
    parse_verdict,
    replay_sample,
    split_for_audit,
    train_reward_model_round,
)
from rlhf_core.data.demo_task import addition_exact_match


def correct(prompts, responses):
    return addition_exact_match(prompts, responses)


ITEMS = [
    Item("12+07=", "019", "018"),  # a right
    Item("03+04=", "006", "007"),  # b right
    Item("25+25=", "050", "050"),  # both right: a tie
    Item("09+09=", "017", "016"),  # both wrong: a tie
]


def test_simulated_annotator_prefers_the_right_answer_and_skips_ties():
    out = SimulatedAnnotator(correct, noise=0.0, seed=0).annotate(ITEMS, "r1")
    assert out.pairs == [{"prompt": "12+07=", "chosen": "019", "rejected": "018"},
                         {"prompt": "03+04=", "chosen": "007", "rejected": "006"}]
    assert out.counts["asked"] == 4 and out.counts["labelled"] == 2 and out.counts["tie"] == 2


def test_simulated_label_noise_flips_about_its_share():
    items = [Item("12+07=", "019", "018")] * 2000
    out = SimulatedAnnotator(correct, noise=0.1, seed=3).annotate(items, "r1")
    wrong = sum(p["chosen"] == "018" for p in out.pairs)
    assert wrong == out.counts["flipped"]
    assert 0.08 < wrong / 2000 < 0.12  # binomial sd 0.0067: 3 sd either side


def test_simulated_noise_must_leave_the_labels_informative():
    with pytest.raises(ValueError, match="label noise"):
        SimulatedAnnotator(correct, noise=0.5, seed=0)


@pytest.mark.parametrize("reply,verdict", [
    ("[[A]]", "A"), ("The second is right. [[B]]", "B"), ("B", "B"), (" (A). ", "A"), ("[[ B ]]", "B"),
    ("[[A]] or [[B]]", None), ("Both are wrong", None), ("", None), ("AB", None), ("A is better than B", None),
])
def test_parse_verdict(reply, verdict):
    assert parse_verdict(reply) == verdict


@pytest.mark.parametrize("reply,verdict", [
    ("019", "A"), (" 018\nmore text", "B"), ("017", None), ("", None),
])
def test_parse_match_answer(reply, verdict):
    assert parse_match_answer(reply, Item("12+7=", "019", "018")) == verdict
    assert parse_match_answer("050", Item("25+25=", "050", "050")) is None  # both match: no preference


def _judge(replies: list[dict | Exception], **cfg) -> JudgeAnnotator:
    """A judge whose endpoint answers with `replies` in order (an httpx transport, so the
    annotator's own request and parsing code runs)."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        reply = replies[len(seen) - 1]
        if isinstance(reply, Exception):
            raise reply
        if "status" in reply:
            return httpx.Response(reply["status"], json={"error": "x"})
        return httpx.Response(200, json={"choices": [reply]})

    judge_cfg = JudgeConfig(base_url="http://judge.invalid/v1", model="judge", **cfg)
    annotator = JudgeAnnotator(judge_cfg, client=httpx.Client(base_url="http://judge.invalid/v1",
                                                              transport=httpx.MockTransport(handler)))
    annotator.seen = seen
    return annotator


def test_judge_replies_that_are_malformed_refused_or_failed_are_counted_never_labels():
    judge = _judge([
        {"text": "[[A]]", "finish_reason": "stop"},
        {"text": "I cannot compare these.", "finish_reason": "stop"},  # malformed
        {"text": "", "finish_reason": "stop"},  # refused: nothing said
        {"text": "[[B]]", "finish_reason": "content_filter"},  # refused by a filter
        {"status": 500},  # error
        httpx.ConnectError("down"),  # error
    ])
    items = [Item(f"{i}+1=", "a", "b") for i in range(6)]
    out = judge.annotate(items, "r1")
    assert out.pairs == [{"prompt": "0+1=", "chosen": "a", "rejected": "b"}]
    assert dict(out.counts) == {"asked": 6, "labelled": 1, "malformed": 1, "refused": 2, "error": 2}
    assert judge.seen[0] == {"model": "judge", "prompt": JudgeConfig().template.format(
        prompt="0+1=", answer_a="a", answer_b="b"), "max_tokens": 16, "temperature": 0.0}


def test_judge_chat_api_sends_the_template_as_the_user_turn():
    judge = _judge([{"message": {"role": "assistant", "content": "[[B]]"}, "finish_reason": "stop"}], api="chat")
    out = judge.annotate([Item("1+1=", "003", "002")], "r1")
    assert out.pairs == [{"prompt": "1+1=", "chosen": "002", "rejected": "003"}]
    assert judge.seen[0]["messages"][0]["role"] == "user"


def test_queue_writes_a_batch_for_people_and_picks_up_their_labels_next_time(tmp_path):
    queue = QueueAnnotator(tmp_path / "q")
    first = queue.annotate(ITEMS[:2], "round-1")
    assert first.pairs == [] and first.counts["queued"] == 2  # nothing labelled now: the run goes on
    rows = [json.loads(line) for line in (tmp_path / "q" / "pending" / "round-1.jsonl").read_text().splitlines()]
    assert rows[0] == {"id": "round-1-0", "prompt": "12+07=", "answer_a": "019", "answer_b": "018"}

    labelled = tmp_path / "q" / "labelled"
    labelled.mkdir()
    answers = [{**rows[0], "choice": "A"}, {**rows[1], "choice": "tie"}, {**rows[1], "choice": "maybe"}]
    (labelled / "batch.jsonl").write_text("\n".join(json.dumps(r) for r in answers) + "\nnot json\n")
    second = queue.annotate(ITEMS[2:], "round-2")
    assert second.pairs == [{"prompt": "12+07=", "chosen": "019", "rejected": "018"}]
    assert second.counts["picked_up"] == 3 and second.counts["tie"] == 1 and second.counts["malformed"] == 2
    assert not (labelled / "batch.jsonl").exists() and (tmp_path / "q" / "consumed" / "round-2" / "batch.jsonl").exists()
    assert queue.annotate([], "round-3").pairs == []  # consumed labels are used once


def test_a_round_redone_after_a_resume_takes_the_labels_its_killed_attempt_took_and_no_later_round_does(tmp_path):
    """The trainer resumes from a checkpoint taken before round 2 and redoes it under its id:
    the labels the killed attempt moved to consumed/ reach the redone round (and its reward
    model), with any labelled since; round 3 takes neither again."""
    queue = QueueAnnotator(tmp_path / "q")
    labelled = tmp_path / "q" / "labelled"
    labelled.mkdir(parents=True)
    row = {"prompt": "12+07=", "answer_a": "019", "answer_b": "018"}
    (labelled / "early.jsonl").write_text(json.dumps({**row, "choice": "A"}) + "\n")
    killed = queue.annotate(ITEMS[:1], "round-2")  # the attempt that is killed before its checkpoint
    (labelled / "late.jsonl").write_text(json.dumps({**row, "choice": "B"}) + "\n")
    redone = queue.annotate(ITEMS[:1], "round-2")
    assert killed.counts["labelled"] == 1 and redone.counts["labelled"] == 2
    assert sorted(p["chosen"] for p in redone.pairs) == ["018", "019"]
    assert len((tmp_path / "q" / "pending" / "round-2.jsonl").read_text().splitlines()) == 1  # one batch, rewritten
    assert queue.annotate([], "round-3").counts["labelled"] == 0


def test_make_annotator_needs_an_answer_key_for_the_simulated_one(tmp_path):
    with pytest.raises(ValueError, match="verifiable_reward"):
        make_annotator(RoundsConfig(), None, tmp_path, seed=0)
    assert isinstance(make_annotator(RoundsConfig(annotator="queue"), None, tmp_path, seed=0), QueueAnnotator)


def test_identical_answers_are_not_worth_a_label():
    kept, identical = identical_items(ITEMS)
    assert identical == 1 and Item("25+25=", "050", "050") not in kept


def test_the_contract_drops_the_rows_it_names():
    pairs = [{"prompt": "1+1=", "chosen": "002", "rejected": "003"},
             {"prompt": "2+2=", "chosen": "", "rejected": "005"},  # an empty answer
             {"prompt": "3+3=", "chosen": "006", "rejected": "006"}]  # chosen == rejected
    kept, dropped = contract_filter(pairs, ValidationConfig())
    assert kept == pairs[:1] and dropped == 2
    assert contract_filter([], ValidationConfig()) == ([], 0)


def test_replay_draws_without_replacement():
    old = [{"prompt": str(i)} for i in range(10)]
    sample = replay_sample(old, 4, seed=0)
    assert len(sample) == 4 and len({s["prompt"] for s in sample}) == 4
    assert replay_sample(old, 20, seed=0) == old


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tok = train_tokenizer([f"{a}+{b}={a + b:03d}" for a in range(30) for b in range(30)], vocab_size=300)
    tiny = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2)
    return save_pretrained_atomic(build_policy(tiny, tok, seed=0), tok, tmp_path_factory.mktemp("base") / "sft")


@pytest.mark.parametrize("members", [1, 3])
def test_a_round_teaches_the_reward_model_its_pairs_and_restates_its_scale(base, members):
    torch.manual_seed(0)
    model = reward_model_from_base(base, seed=0, num_members=members).eval()
    tok = load_tokenizer(base)
    pairs = [{"prompt": f"{a}+{b}=", "chosen": f"{a + b:03d}", "rejected": f"{a + b - 10:03d}"}
             for a in range(10, 26) for b in range(10, 14)]
    cfg = RoundsConfig(epochs=4, batch_size=16, learning_rate=3e-3)

    def accuracy():
        prompts = [p["prompt"] for p in pairs]
        chosen = member_mean(score_members(model, tok, prompts, [p["chosen"] for p in pairs], 32))
        rejected = member_mean(score_members(model, tok, prompts, [p["rejected"] for p in pairs], 32))
        return (chosen > rejected).float().mean().item(), torch.cat([chosen, rejected])

    before, _ = accuracy()
    stats, central, metrics = train_reward_model_round(model, tok, pairs, cfg, max_length=32, seed=0)
    after, scores = accuracy()
    assert after >= 0.9 > before or after > before + 0.3
    assert len(stats) == members and metrics["rounds/rm_steps"] == 4 * 4
    assert central.mean == pytest.approx(scores.double().mean().item(), abs=1e-5)  # the scale on these pairs
    assert central.std == pytest.approx(scores.double().std(unbiased=False).item(), abs=1e-5)
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


def test_the_audit_and_the_proxy_never_share_a_label():
    pairs = [{"prompt": str(i), "chosen": "a", "rejected": "b"} for i in range(400)]
    proxy, audit = split_for_audit(pairs, 0.25, seed=0)
    assert sorted(p["prompt"] for p in proxy + audit) == sorted(p["prompt"] for p in pairs)
    assert not {p["prompt"] for p in proxy} & {p["prompt"] for p in audit}
    assert 0.18 < len(audit) / 400 < 0.32  # binomial sd 0.022: 3 sd either side
    assert split_for_audit(pairs, 0.0, seed=0) == (pairs, [])
