"""One rendering of a conversation, from training to serving: the tokenizer's chat template.

SFT, reward-model scoring, rollouts, evaluation and vLLM's `/v1/chat/completions` must see the
same text for the same conversation, or the policy is trained on one format and served in
another. Everything here goes through `apply_chat_template` with the template the model
directory carries (or `model.chat_template`), as vLLM's server does:

- a prompt is rendered with the generation prompt (the opening of the assistant's turn), the
  text a policy continues;
- a response is the text the template writes after that prompt when the conversation goes on
  with it: rendering `prompt + response` and cutting the rendered prompt off. A template that
  renders the prompt differently once an answer follows cannot be split that way, and is
  refused with the first place where the two renderings part.

Tokens: a rendered prompt is encoded as any text is (`tokenizer(text)`, special tokens
added), the way vLLM encodes the text prompts of rollouts. A template that writes the BOS
token itself would then get a second one, so `render_prompt` leaves the template's leading
BOS to the tokenizer; `check_rendering` proves on the data's own prompts that the ids equal
those vLLM's chat server encodes (the template's text, no special tokens added) and refuses a
tokenizer/template pair where they cannot be equal. A response ends at the tokenizer's EOS
token: text the template writes after it (a newline between turns) is not part of what the
policy generates, and `response_ids` appends EOS only when the text does not already end
with it.

Plain-text prompts and responses (the standard format) pass through untouched.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

Messages = list[dict[str, Any]]


class ChatTemplateError(ValueError):
    """The data needs a chat template that the tokenizer does not have, or cannot use."""


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def require_chat_template(tokenizer, where: str) -> None:
    if not has_chat_template(tokenizer):
        raise ChatTemplateError(
            f"{where}: the data is conversational but the tokenizer has no chat template; set "
            "`model.chat_template` to a Jinja template (or a file holding one), or give the model "
            "directory a `chat_template.jinja`"
        )


def read_chat_template(value: str) -> str:
    """`model.chat_template`: the Jinja text itself, or the path of a file holding it."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ChatTemplateError(f"model.chat_template: {value!r} is neither a Jinja template nor a file")
    return path.read_text(encoding="utf-8")


def adds_bos(tokenizer) -> bool:
    """Whether encoding a text puts the BOS token in front of it."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


def served_prompt_ids(tokenizer, prompt: Messages) -> list[int]:
    """The ids vLLM's `/v1/chat/completions` feeds the model: the template's text, no special
    tokens added."""
    text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render_prompt(tokenizer, prompt: str | Messages) -> str:
    """The text a policy continues for `prompt`."""
    if isinstance(prompt, str):
        return prompt
    require_chat_template(tokenizer, "render_prompt")
    text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and adds_bos(tokenizer):
        text = text[len(bos):]  # the tokenizer puts it back
    return text


def check_rendering(tokenizer, prompts: Sequence[Messages], where: str = "data") -> None:
    """Raise `ChatTemplateError` unless each prompt's training ids equal the served ids."""
    for i, prompt in enumerate(prompts):
        ours = tokenizer(render_prompt(tokenizer, prompt))["input_ids"]
        served = served_prompt_ids(tokenizer, prompt)
        if ours != served:
            hint = (" The tokenizer adds its BOS token to every text but the template does not write it: start "
                    "the template with {{ bos_token }}." if adds_bos(tokenizer) and served[:1] != ours[:1] else "")
            raise ChatTemplateError(
                f"{where}: prompt {i} encodes to {len(ours)} ids in training but {len(served)} in serving "
                f"(first ids {ours[:4]} vs {served[:4]}).{hint}")


def response_ids(tokenizer, response: str) -> list[int]:
    """Token ids of a response text, ending with EOS (added unless the text ends with it)."""
    ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    return ids if ids and ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id]


def render_response(tokenizer, prompt: str | Messages, response: str | Messages) -> str:
    """The text that follows `render_prompt(prompt)` when the conversation goes on with `response`."""
    if isinstance(prompt, str) != isinstance(response, str):
        raise ChatTemplateError("a prompt and its response must both be text or both be messages")
    if isinstance(response, str):
        return response
    require_chat_template(tokenizer, "render_response")
    head = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(list(prompt) + list(response), tokenize=False)
    if not full.startswith(head):
        at = next((i for i, (a, b) in enumerate(zip(head, full)) if a != b), min(len(head), len(full)))
        raise ChatTemplateError(
            "the chat template renders the prompt differently once an answer follows, so the answer "
            f"cannot be cut off it; they part at character {at}: {head[at:at + 40]!r} vs {full[at:at + 40]!r}"
        )
    response_text = full[len(head):]
    eos = tokenizer.eos_token
    if eos and eos in response_text:  # the turn ends at EOS; what follows is the template's spacing
        response_text = response_text[: response_text.rindex(eos) + len(eos)]
    return response_text


def render_pairs(tokenizer, prompts: Sequence[Any], responses: Sequence[Any]) -> tuple[list[str], list[str]]:
    """`render_prompt` and `render_response` over aligned lists."""
    return ([render_prompt(tokenizer, p) for p in prompts],
            [render_response(tokenizer, p, r) for p, r in zip(prompts, responses, strict=True)])
