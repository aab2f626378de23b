import re

import pytest

from rlhf_core.chat import ChatTemplateError, render_pairs, render_prompt, render_response
from rlhf_core.tokenizer import train_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Marks the last message: the prompt's last turn renders differently once an answer follows.
LAST_MARKED = "{% for m in messages %}{{ m['role'] }}{% if loop.last %}*{% endif %}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer():
    tok = train_tokenizer(["hello there", "what colour is the sky", "blue green"], vocab_size=300)
    tok.chat_template = CHATML
    return tok


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_a_prompt_renders_with_the_generation_prompt(tokenizer):
    assert render_prompt(tokenizer, [user("Sky?")]) == "<|im_start|>user\nSky?<|im_end|>\n<|im_start|>assistant\n"


def test_prompt_plus_response_is_the_whole_conversation_rendered(tokenizer):
    prompt, response = [user("Sky?")], [assistant("Blue.")]
    whole = tokenizer.apply_chat_template(prompt + response, tokenize=False)
    assert render_prompt(tokenizer, prompt) + render_response(tokenizer, prompt, response) == whole
    assert render_response(tokenizer, prompt, response) == "Blue.<|im_end|>\n"


def test_text_passes_through_and_mixing_text_with_messages_is_refused(tokenizer):
    assert render_pairs(tokenizer, ["07+48="], ["055"]) == (["07+48="], ["055"])
    with pytest.raises(ChatTemplateError, match="both be text or both be messages"):
        render_response(tokenizer, "Sky?", [assistant("Blue.")])


def test_a_tokenizer_without_a_template_says_how_to_set_one():
    tok = train_tokenizer(["hello"], vocab_size=300, chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat template; set `model.chat_template`"):
        render_prompt(tok, [user("Sky?")])


def test_a_template_that_renders_the_prompt_differently_before_an_answer_is_refused(tokenizer):
    tok = train_tokenizer(["hello"], vocab_size=300)
    tok.chat_template = LAST_MARKED
    with pytest.raises(ChatTemplateError, match=re.escape("part at character 4: '*: Sky?\\n' vs ': Sky?\\nassistant*")):
        render_response(tok, [user("Sky?")], [assistant("Blue.")])
