"""The demo's tokenizer and its chat template (`rlhf_core.tokenizer`): a chat of one user
message feeds the model the ids of the demo's plain prompt, the template survives a save and
reload, and having it changes nothing the demo trains on."""
from __future__ import annotations

import jinja2
import pytest
import torch
from transformers import AutoTokenizer

from rlhf_core.chat import (ChatTemplateError, check_rendering, render_pairs, render_prompt, render_response,
                            served_prompt_ids)
from rlhf_core.config import DemoDataConfig
from rlhf_core.data.pairs import tokenize_pairs, tokenize_policy_pairs
from rlhf_core.data.prepare import Limits, prepare_inputs
from rlhf_core.data.schema import read_table
from rlhf_core.data.synthetic import generate_demo_data
from rlhf_core.tokenizer import DEMO_CHAT_TEMPLATE, load_tokenizer, train_tokenizer
from rlhf_core.training.sft import encode_sft_batch

DEMO = DemoDataConfig(n_sft=200, n_pairs=100, n_eval=50)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's files, and its tokenizer trained as the SFT task trains it (on every
    prompt + answer), with the template (as the pipeline now has it) and without."""
    files = generate_demo_data(DEMO, tmp_path_factory.mktemp("demo"))
    sft, prefs = read_table(files.sft), read_table(files.preferences)
    texts = (list(sft["prompt"] + sft["completion"]) + list(prefs["prompt"] + prefs["chosen"])
             + list(prefs["prompt"] + prefs["rejected"]))
    return files, train_tokenizer(texts, 64), train_tokenizer(texts, 64, chat_template=None)


def test_one_user_message_is_the_demo_prompt_and_its_ids(demo):
    _, tok, _ = demo
    chat = [user("12+34=")]
    # vLLM encodes a chat's text with no special tokens added: the template writes the BOS
    # that training and /v1/completions get from the tokenizer
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == "<s>12+34="
    assert tok.apply_chat_template(chat, add_generation_prompt=False, tokenize=False) == "<s>12+34="
    assert render_prompt(tok, chat) == "12+34="
    assert served_prompt_ids(tok, chat) == tok("12+34=")["input_ids"]


def test_a_template_of_the_contents_alone_would_serve_prompts_without_bos():
    tok = train_tokenizer(["12+34=046"], 64, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert served_prompt_ids(tok, [user("12+34=")]) == tok("12+34=")["input_ids"][1:]
    with pytest.raises(ChatTemplateError, match=r"start the template with \{\{ bos_token \}\}"):
        check_rendering(tok, [[user("12+34=")]])


def test_every_demo_prompt_is_served_as_it_is_trained(demo):
    files, tok, _ = demo
    prompts = list(read_table(files.eval)["prompt"])
    check_rendering(tok, [[user(p)] for p in prompts])  # training ids == served ids, or it raises
    assert all(render_prompt(tok, [user(p)]) == p for p in prompts)


def test_a_conversation_joins_its_turns_with_answers_ending_at_eos_and_no_system_message(demo):
    _, tok, _ = demo
    chat = [{"role": "system", "content": "You are a helpful assistant."}, user("12+34="), assistant("046"),
            user("01+02=")]
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == "<s>12+34=046</s>01+02="
    # an answer renders as a demo completion is trained: its text, then EOS
    assert render_response(tok, [user("12+34=")], [assistant("046")]) == "046</s>"


def test_a_role_it_cannot_render_is_a_template_error(demo):
    _, tok, _ = demo
    with pytest.raises(jinja2.TemplateError, match="cannot render a tool message"):
        tok.apply_chat_template([user("12+34="), {"role": "tool", "content": "46"}], tokenize=False)


def test_a_saved_and_reloaded_tokenizer_keeps_the_template(demo, tmp_path):
    _, tok, bare = demo
    tok.save_pretrained(str(tmp_path / "tok"))
    bare.save_pretrained(str(tmp_path / "bare"))
    for loaded in (AutoTokenizer.from_pretrained(str(tmp_path / "tok")), load_tokenizer(tmp_path / "tok")):
        assert loaded.chat_template == DEMO_CHAT_TEMPLATE
        assert render_prompt(loaded, [user("12+34=")]) == "12+34="
        assert served_prompt_ids(loaded, [user("12+34=")]) == tok("12+34=")["input_ids"]
    assert AutoTokenizer.from_pretrained(str(tmp_path / "bare")).chat_template is None
    # the template is the only difference: vocabulary, merges and processors are the same bytes
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == (tmp_path / "bare" / "tokenizer.json").read_bytes()


def test_the_template_changes_nothing_the_demo_trains_on(demo, tmp_path):
    """Every path the demo's plain-text data takes: preparation (None is what the pipeline
    passes for the demo; a tokenizer with or without the template gives the same files),
    then the ids of SFT, reward-model pairs, policy pairs and eval/rollout prompts."""
    files, tok, bare = demo
    limits = Limits(pair_tokens=32)
    prepared = [prepare_inputs(files.preferences, files.eval, files.sft, files.eval, t, limits, tmp_path / name)
                for name, t in (("none", None), ("bare", bare), ("templated", tok))]
    assert not any(p.conversational for p in prepared)
    for attr in ("preferences", "eval", "sft", "prompts"):
        tables = [read_table(getattr(p, attr)).to_dict("records") for p in prepared]
        assert tables[0] == tables[1] == tables[2]
    sft, prefs = read_table(files.sft), read_table(files.preferences).to_dict("records")
    prompts, completions = list(sft["prompt"]), list(sft["completion"])
    assert render_pairs(tok, prompts, completions) == (prompts, completions)
    a, b = encode_sft_batch(tok, prompts, completions), encode_sft_batch(bare, prompts, completions)
    for name in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    for tokenize in (tokenize_pairs, tokenize_policy_pairs):
        x, y = tokenize(prefs, tok, 32), tokenize(prefs, bare, 32)
        assert all((getattr(x, f) == getattr(y, f)).all() for f in ("chosen_ids", "chosen_lengths", "rejected_ids",
                                                                     "rejected_lengths"))
    eval_prompts = list(read_table(files.eval)["prompt"])
    assert tok(eval_prompts)["input_ids"] == bare(eval_prompts)["input_ids"]


def test_no_template_when_asked_for_none():
    assert train_tokenizer(["12+34=046"], 64, chat_template=None).chat_template is None
