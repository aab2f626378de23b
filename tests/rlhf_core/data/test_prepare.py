"""The user's data checked and rendered before anything trains (`rlhf_core.data.prepare`)."""
from __future__ import annotations

import datasets
import pytest

from rlhf_core.chat import ChatTemplateError, render_prompt
from rlhf_core.data.prepare import InputError, Limits, prepare_inputs
from rlhf_core.data.schema import read_table, write_jsonl
from rlhf_core.tokenizer import load_tokenizer

ZEPHYR = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def pair(i, chosen="Blue.", rejected="Green."):
    return {"prompt": [user(f"Sky {i}?")], "chosen": [assistant(chosen)], "rejected": [assistant(rejected)]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, make_pretrained):
    path, _ = make_pretrained(tmp_path_factory.mktemp("m"), "qwen2", chat_template=ZEPHYR)
    return load_tokenizer(path)


def prepare(tmp_path, rows, tokenizer, limits=Limits(), **sets):
    write_jsonl(rows, tmp_path / "in.jsonl")
    return prepare_inputs(tmp_path / "in.jsonl", sets.get("eval"), sets.get("sft"), sets.get("prompts"),
                          tokenizer, limits, tmp_path / "out", sets.get("labelled"))


def test_conversational_pairs_are_rendered_once_by_the_template(tmp_path, tokenizer):
    files = prepare(tmp_path, [pair(i) for i in range(3)], tokenizer)
    rows = read_table(files.preferences).to_dict("records")
    assert files.conversational and files.preferences == tmp_path / "out" / "preferences.jsonl"
    # the template's BOS is left to the tokenizer; the answer ends at the EOS token
    assert rows[0]["prompt"] == "<|user|>\nSky 0?</s>\n<|assistant|>\n" == render_prompt(tokenizer, [user("Sky 0?")])
    assert rows[0]["chosen"] == "Blue.</s>" and rows[0]["rejected"] == "Green.</s>"
    assert tokenizer(rows[0]["prompt"])["input_ids"] == tokenizer.apply_chat_template(
        [user("Sky 0?")], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def test_a_standard_file_that_needs_nothing_is_used_where_it_is(tmp_path, tokenizer):
    rows = [{"prompt": f"{i}+1=", "chosen": "ok", "rejected": "no"} for i in range(3)]
    files = prepare(tmp_path, rows, tokenizer)
    assert files.preferences == tmp_path / "in.jsonl" and not files.conversational


def test_an_implicit_prompt_is_extracted_from_the_shared_start(tmp_path, tokenizer):
    rows = [{"chosen": [user("Sky?"), assistant("Blue.")], "rejected": [user("Sky?"), assistant("Red.")]}]
    files = prepare(tmp_path, rows, tokenizer)
    [row] = read_table(files.preferences).to_dict("records")
    assert row["prompt"] == render_prompt(tokenizer, [user("Sky?")]) and row["rejected"] == "Red.</s>"
    assert "extracted" in files.notes[0]


def test_an_implicit_prompt_that_is_not_shared_is_refused_with_its_row(tmp_path, tokenizer):
    rows = [{"chosen": [user("Sky?"), assistant("Blue.")], "rejected": [user("Sky?"), assistant("Red.")]},
            {"chosen": [user("Sea?"), assistant("Blue.")], "rejected": [user("Grass?"), assistant("Green.")]}]
    with pytest.raises(InputError, match=r"in.jsonl: row 2 \(line 2\), column 'chosen': shares no prompt"):
        prepare(tmp_path, rows, tokenizer)


def test_roles_out_of_order_are_refused_with_row_and_column(tmp_path, tokenizer):
    bad = {"prompt": [user("Hi"), user("Again")], "chosen": [assistant("a")], "rejected": [assistant("b")]}
    with pytest.raises(InputError, match=r"row 3 \(line 3\), column 'prompt': turn 1 is 'user' where 'assistant'"):
        prepare(tmp_path, [pair(0), pair(1), bad], tokenizer)
    empty = pair(2, chosen=" ")
    with pytest.raises(InputError, match=r"row 1 \(line 1\), column 'chosen': an assistant turn is empty"):
        prepare(tmp_path, [empty], tokenizer)


def test_conversational_data_without_a_template_says_how_to_set_one(tmp_path, make_pretrained):
    path, _ = make_pretrained(tmp_path, "llama", chat_template=False)
    with pytest.raises(ChatTemplateError, match="no chat template; set `model.chat_template`"):
        prepare(tmp_path, [pair(0)], load_tokenizer(path))
    with pytest.raises(InputError, match="needs a tokenizer with a chat template: set `model.pretrained`"):
        prepare(tmp_path, [pair(0)], None)


def test_a_template_without_the_bos_the_tokenizer_adds_is_refused(tmp_path, make_pretrained):
    chatml = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"
    path, _ = make_pretrained(tmp_path, "llama", chat_template=chatml)
    with pytest.raises(ChatTemplateError, match=r"start the template with \{\{ bos_token \}\}"):
        prepare(tmp_path, [pair(0)], load_tokenizer(path))


def test_pairs_over_the_length_limit_are_counted_or_rejected(tmp_path, tokenizer):
    rows = [pair(0), pair(1, chosen="Blue " * 40)]
    with pytest.raises(InputError, match=r"1 of 2 rows have prompt \+ response longer than reward.max_length=40 "
                                         r"tokens \(lines 2\); reward.on_overlength is reject"):
        prepare(tmp_path, rows, tokenizer, Limits(pair_tokens=40, pair_on_overlength="reject"))
    files = prepare(tmp_path, rows, tokenizer, Limits(pair_tokens=40, pair_on_overlength="truncate"))
    assert files.notes == ["" + str(tmp_path / "in.jsonl") + ": 1 of 2 rows have prompt + response longer than "
                           "reward.max_length=40 tokens (lines 2): truncated to it"]


def test_prompt_sets_from_datasets_and_parquet_are_rendered_and_long_prompts_dropped(tmp_path, tokenizer):
    evals = [{"prompt": [user("12+34=")], "answer": "46"}, {"prompt": [user("9 " * 60)], "answer": "x"}]
    datasets.Dataset.from_list(evals).save_to_disk(str(tmp_path / "eval"))
    datasets.Dataset.from_list([{"prompt": [user("Sky?")]}]).to_parquet(str(tmp_path / "prompts.parquet"))
    limits = Limits(prompt_tokens=40, prompt_on_overlength="drop")
    files = prepare(tmp_path, [pair(0)], tokenizer, limits, eval=tmp_path / "eval", prompts=tmp_path / "prompts.parquet")
    assert read_table(files.eval).to_dict("records") == [
        {"prompt": render_prompt(tokenizer, [user("12+34=")]), "answer": "46", "_line": 1}]
    assert list(read_table(files.prompts)["prompt"]) == [render_prompt(tokenizer, [user("Sky?")])]
    assert "1 of 2 rows have a prompt longer than 40 tokens" in files.notes[0] and "left out" in files.notes[0]
    with pytest.raises(InputError, match="data.on_overlength is reject"):
        prepare(tmp_path, [pair(0)], tokenizer, Limits(prompt_tokens=40), eval=tmp_path / "eval")


def test_an_sft_conversation_trains_on_its_last_assistant_turn(tmp_path, tokenizer):
    sft = [{"messages": [user("Hi"), assistant("Hello."), user("Sky?"), assistant("Blue.")]}]
    write_jsonl(sft, tmp_path / "sft.jsonl")
    files = prepare(tmp_path, [pair(0)], tokenizer, sft=tmp_path / "sft.jsonl")
    [row] = read_table(files.sft).to_dict("records")
    assert row["prompt"] == render_prompt(tokenizer, sft[0]["messages"][:3]) and row["completion"] == "Blue.</s>"


def test_rated_answers_are_rendered_as_the_pairs_are_and_keep_their_label(tmp_path, tokenizer):
    """KTO's answers rated in the feedback: the same rendering as the pairs' answers."""
    labelled = [{"prompt": [user("Sky 0?")], "completion": [assistant("Blue.")], "desirable": True, "source": "f"},
                {"prompt": [user("Sky 1?")], "completion": [assistant("Red.")], "desirable": False, "source": "f"}]
    write_jsonl(labelled, tmp_path / "labelled.jsonl")
    files = prepare(tmp_path, [pair(0), pair(1)], tokenizer, labelled=tmp_path / "labelled.jsonl")
    pairs = read_table(files.preferences).to_dict("records")
    rows = read_table(files.labelled).drop(columns="_line").to_dict("records")
    assert files.labelled == tmp_path / "out" / "labelled.jsonl"
    assert rows[0] == {"prompt": pairs[0]["prompt"], "completion": pairs[0]["chosen"], "desirable": True, "source": "f"}
    assert rows[1]["prompt"] == pairs[1]["prompt"] and rows[1]["completion"] == "Red.</s>" and not rows[1]["desirable"]
    write_jsonl([{"prompt": [user("Sky?")], "desirable": True}], tmp_path / "bad.jsonl")
    with pytest.raises(InputError, match=r"bad.jsonl.*column 'completion' is missing"):
        prepare(tmp_path, [pair(0)], tokenizer, labelled=tmp_path / "bad.jsonl")
