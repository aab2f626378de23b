"""The chat task: conversational pairs whose chosen answer is right and rejected one wrong under
the task's own checker, and an eval set no training prompt shares operands with."""
from __future__ import annotations

import re

from rlhf_core.data.chat_task import generate_chat_task, main
from rlhf_core.data.schema import read_table
from rlhf_core.training.verifiable import last_number_match

OPERANDS = re.compile(r"(\d+)\D+(\d+)")


def _text(messages) -> str:
    [turn] = list(messages)
    return turn["content"]


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_ones(tmp_path):
    one, two, other = (generate_chat_task(tmp_path / d, seed=s, n_pairs=200, n_prompts=64, n_eval=40)
                       for d, s in (("a", 0), ("b", 0), ("c", 1)))
    for name in ("preferences", "prompts", "eval"):
        assert getattr(one, name).read_bytes() == getattr(two, name).read_bytes()
        assert getattr(one, name).read_bytes() != getattr(other, name).read_bytes()


def test_chosen_is_right_rejected_is_wrong_and_eval_operands_are_held_out(tmp_path):
    files = generate_chat_task(tmp_path, seed=3, n_pairs=600, n_prompts=128, n_eval=100)
    pairs = read_table(files.preferences).to_dict("records")
    prompts, chosen, rejected = ([_text(r[k]) for r in pairs] for k in ("prompt", "chosen", "rejected"))
    answers = [str(sum(map(int, OPERANDS.search(p).groups()))) for p in prompts]
    assert last_number_match(prompts, chosen, answers).tolist() == [1.0] * len(pairs)
    assert last_number_match(prompts, rejected, answers).sum().item() == 0
    assert len({p.split(" ")[0] for p in prompts}) > 4 and len({c.split(" ")[0] for c in chosen}) > 2  # phrasings vary
    assert sum("add them" in r or "combine" in r or "simple arithmetic" in r for r in rejected) > 60  # no sum at all
    evals = read_table(files.eval).to_dict("records")
    rl = read_table(files.prompts).to_dict("records")
    assert len(evals) == 100 and len(rl) == 128
    ops = lambda rows: {OPERANDS.search(_text(r["prompt"])).groups() for r in rows}  # noqa: E731
    assert not ops(evals) & (ops(rl) | {OPERANDS.search(p).groups() for p in prompts})
    for row in evals + rl:
        a, b = OPERANDS.search(_text(row["prompt"])).groups()
        assert row["answer"] == str(int(a) + int(b))


def test_the_command_writes_the_files_it_names(tmp_path, capsys):
    main([str(tmp_path / "out"), "--seed", "2"])
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed] == ["preferences", "prompts", "eval"]
    assert all((tmp_path / "out" / f).is_file() for f in ("pairs.jsonl", "prompts.jsonl", "eval.jsonl"))


def test_the_chat_config_learns_from_the_reward_model_alone_and_only_measures_with_the_checker(tmp_path):
    """configs/chat.yaml reads what the generator writes, judges accuracy with the checker and
    keeps the answer key out of the policy's reward."""
    from pathlib import Path

    from rlhf_core.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[3] / "configs" / "chat.yaml")
    files = generate_chat_task(tmp_path / "runs" / "chat-data", seed=0, n_pairs=20, n_prompts=8, n_eval=8)
    for key, written in (("preferences_path", files.preferences), ("prompts_path", files.prompts),
                         ("eval_path", files.eval)):
        assert Path(getattr(cfg.data, key)).name == written.name
    assert cfg.data.answer_checker == "last_number_match" and not cfg.sft.enabled
    policy = cfg.policy
    assert (policy.reward_model_weight, policy.verifiable_reward_weight, policy.verifiable_reward) == (1.0, 0.0, None)
    assert cfg.model.pretrained.endswith("smollm2-135m-instruct") and "~" not in cfg.model.pretrained
