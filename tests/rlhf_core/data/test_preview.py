"""Rows as the trainer sees them (`rlhf_core.data.preview`): the counts are the trainer's own."""
from __future__ import annotations

import pytest

from rlhf_core.data.pairs import tokenize_pairs, tokenize_policy_pairs
from rlhf_core.data.preview import preview_rows
from rlhf_core.tokenizer import train_tokenizer

ZEPHYR = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def tok():
    tokenizer = train_tokenizer([f"{a}+{b}={a + b}" for a in range(30) for b in range(30)]
                                + ["What colour is the sky? Blue. Green."], vocab_size=300)
    tokenizer.chat_template = ZEPHYR
    return tokenizer


ROWS = [{"prompt": "12+34=", "chosen": "046", "rejected": "036"},
        {"prompt": "7+8=", "chosen": "15", "rejected": "1"},
        {"prompt": "29+29=", "chosen": "058", "rejected": "048 or maybe 049"}]


def test_a_text_pair_is_counted_and_cut_where_the_reward_trainer_cuts_it(tok):
    [view] = preview_rows(ROWS[:1], tok, max_length=9, lines=[3])
    # <s> 1 2 + 3 4 = | 0 4 6 </s>: digits are single tokens in the demo's tokenizer
    assert (view.line, view.prompt, view.prompt_tokens) == (3, "12+34=", 7)
    assert (view.chosen.text, view.chosen.tokens, view.chosen.scored_tokens) == ("046", 4, 11)
    assert (view.chosen.cut_tokens, view.chosen.cut_text) == (2, "6</s>")
    assert view.truncated and not view.conversational


@pytest.mark.parametrize("max_length", [6, 9, 12, 64])
def test_the_counts_are_those_of_the_reward_and_policy_tokenization(tok, max_length):
    views = preview_rows(ROWS, tok, max_length)
    scored = tokenize_pairs(ROWS, tok, max_length)
    assert [min(v.chosen.scored_tokens, max_length) for v in views] == scored.chosen_lengths.tolist()
    assert [min(v.rejected.scored_tokens, max_length) for v in views] == scored.rejected_lengths.tolist()
    assert sum(v.truncated for v in views) == scored.truncated
    policy = tokenize_policy_pairs(ROWS, tok, 64)
    assert [v.prompt_tokens for v in views] == policy.prompt_lengths.tolist()
    assert [v.prompt_tokens + v.rejected.tokens for v in views] == policy.rejected_lengths.tolist()


def test_a_conversation_is_rendered_by_the_chat_template(tok):
    row = {"prompt": [{"role": "user", "content": "What colour is the sky?"}],
           "chosen": [{"role": "assistant", "content": "Blue."}],
           "rejected": [{"role": "assistant", "content": "Green."}]}
    [view] = preview_rows([row], tok, max_length=8)
    # the template's BOS is left to the tokenizer; an answer ends at the EOS token
    assert view.conversational and view.prompt == "<|user|>\nWhat colour is the sky?</s>\n<|assistant|>\n"
    assert (view.chosen.text, view.rejected.text) == ("Blue.</s>", "Green.</s>")
    assert view.chosen.cut_tokens == view.chosen.scored_tokens - 8 > 0
    assert view.chosen.cut_text.endswith("Blue.</s>")
