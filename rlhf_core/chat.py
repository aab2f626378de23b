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

Plain-text prompts and responses (the standard format) pass through untouched.
"""
from __future__ import annotations

from collections.abc import Sequence
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


def render_prompt(tokenizer, prompt: str | Messages) -> str:
    """The text a policy continues for `prompt`."""
    if isinstance(prompt, str):
        return prompt
    require_chat_template(tokenizer, "render_prompt")
    return tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)


def render_response(tokenizer, prompt: str | Messages, response: str | Messages) -> str:
    """The text that follows `render_prompt(prompt)` when the conversation goes on with `response`."""
    if isinstance(prompt, str) != isinstance(response, str):
        raise ChatTemplateError("a prompt and its response must both be text or both be messages")
    if isinstance(response, str):
        return response
    head = render_prompt(tokenizer, prompt)
    full = tokenizer.apply_chat_template(list(prompt) + list(response), tokenize=False)
    if not full.startswith(head):
        at = next((i for i, (a, b) in enumerate(zip(head, full)) if a != b), min(len(head), len(full)))
        raise ChatTemplateError(
            "the chat template renders the prompt differently once an answer follows, so the answer "
            f"cannot be cut off it; they part at character {at}: {head[at:at + 40]!r} vs {full[at:at + 40]!r}"
        )
    return full[len(head):]


def render_pairs(tokenizer, prompts: Sequence[Any], responses: Sequence[Any]) -> tuple[list[str], list[str]]:
    """`render_prompt` and `render_response` over aligned lists."""
    return ([render_prompt(tokenizer, p) for p in prompts],
            [render_response(tokenizer, p, r) for p, r in zip(prompts, responses, strict=True)])
