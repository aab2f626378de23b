"""Preference rows as the trainer will see them: rendered text, token counts, what is cut.

`rlhf validate --show N` prints this for the first rows of a file, so that a person sees,
before any training, the text the chat template makes of a conversation and whether
`reward.max_length` cuts into the answers.

The counts are the trainer's own:

- the prompt: `tokenizer(prompt)`, special tokens added, as a policy's prompt is encoded;
- an answer: `rlhf_core.chat.response_ids`, its tokens ending with EOS, as a policy generates it;
- what the reward model scores: `<s> prompt answer </s>` (`rlhf_core.data.pairs.encode_pair_text`),
  of which `rlhf_core.data.pairs.tokenize_pairs` keeps the first `max_length` tokens; the rest
  is `cut`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlhf_core.chat import render_prompt, render_response, response_ids
from rlhf_core.data.formats import is_conversation
from rlhf_core.data.pairs import encode_pair_text


@dataclass(frozen=True)
class AnswerView:
    """One answer of a pair. `scored_tokens`: `<s> prompt answer </s>`; `cut_tokens` of them lie
    past max_length, and `cut_text` is what they decode to (empty when nothing is cut)."""

    text: str
    tokens: int
    scored_tokens: int
    cut_tokens: int
    cut_text: str


@dataclass(frozen=True)
class RowView:
    """One preference row: `line` in its file (None when unknown), `conversational` when the
    prompt was rendered by the chat template."""

    line: int | None
    prompt: str
    prompt_tokens: int
    chosen: AnswerView
    rejected: AnswerView
    conversational: bool

    @property
    def truncated(self) -> bool:
        return self.chosen.cut_tokens > 0 or self.rejected.cut_tokens > 0


def _answer(tokenizer, prompt: str, text: str, max_length: int) -> AnswerView:
    scored = encode_pair_text(tokenizer, prompt, text)
    cut = scored[max_length:]
    return AnswerView(text, len(response_ids(tokenizer, text)), len(scored), len(cut),
                      tokenizer.decode(cut, skip_special_tokens=False) if cut else "")


def preview_rows(rows: Sequence[Mapping[str, Any]], tokenizer, max_length: int,
                 lines: Sequence[int] | None = None) -> list[RowView]:
    """`rows` (explicit prompt, chosen, rejected: text, or messages rendered here with the
    tokenizer's chat template) as the trainer sees them, cut at `max_length` scored tokens."""
    views = []
    for i, row in enumerate(rows):
        conversational = is_conversation(row["prompt"])
        prompt = render_prompt(tokenizer, row["prompt"])
        chosen = render_response(tokenizer, row["prompt"], row["chosen"])
        rejected = render_response(tokenizer, row["prompt"], row["rejected"])
        views.append(RowView(
            lines[i] if lines is not None else None, prompt, len(tokenizer(prompt)["input_ids"]),
            _answer(tokenizer, prompt, chosen, max_length), _answer(tokenizer, prompt, rejected, max_length),
            conversational,
        ))
    return views
