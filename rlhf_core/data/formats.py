"""Preference data in the ecosystem's formats, brought to one explicit-prompt shape.

The formats are TRL's (its "dataset formats" guide), which most published preference sets
follow:

    standard                 {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    conversational           {"prompt": [{"role": "user", "content": "What colour is the sky?"}],
                              "chosen": [{"role": "assistant", "content": "Blue."}],
                              "rejected": [{"role": "assistant", "content": "Green."}]}
    implicit prompt          no `prompt`: `chosen` and `rejected` are whole texts or whole
                             conversations that share the prompt as a prefix (Anthropic HH)

`to_explicit` turns every row into the explicit form of its format (a conversational row keeps
its messages) and names the first problem of a row that cannot be used, with its index and
column. The shared prefix of an implicit row is cut as TRL's `extract_prompt` cuts it: at
the first message (or character) where the two differ, a text prompt keeping no trailing
space. A conversation's prompt must end on a turn that the assistant answers, and both
answers must be non-empty assistant turns.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

ROLES = ("system", "user", "assistant")
Format = Literal["standard", "conversational"]


class DataFormatError(ValueError):
    """A row that no format reads; `row` is its 0-based index, `column` the column at fault."""

    def __init__(self, row: int, column: str, message: str):
        self.row, self.column = row, column
        super().__init__(f"row {row}, column {column!r}: {message}")


@dataclass(frozen=True)
class Explicit:
    """Rows with `prompt`, `chosen` and `rejected`, and what they were."""

    rows: list[dict[str, Any]]
    format: Format
    implicit_prompt: bool  # the prompt was extracted from chosen/rejected


def is_conversation(value: Any) -> bool:
    return isinstance(value, list | tuple) and all(isinstance(m, Mapping) for m in value)


def message_problem(messages: Any, *, prompt: bool) -> str | None:
    """Why `messages` is not a well-formed conversation (None if it is).

    A prompt (`prompt=True`) is an optional system turn, then user and assistant turns that
    alternate and end with a user turn; a response is one or more assistant turns (several
    only when a tool-less conversation continues; they must alternate with user turns)."""
    if not is_conversation(messages) or not messages:
        return "must be a non-empty list of {role, content} messages"
    for i, m in enumerate(messages):
        if set(m) - {"role", "content", "name"} or not {"role", "content"} <= set(m):
            return f"message {i} must have the keys role and content, has {sorted(m)}"
        if m["role"] not in ROLES:
            return f"message {i} has role {m['role']!r}, expected one of {', '.join(ROLES)}"
        if not isinstance(m["content"], str):
            return f"message {i} content must be a string, got {type(m['content']).__name__}"
        if m["role"] == "system" and i > 0:
            return f"message {i}: a system message may only come first"
    turns = [m["role"] for m in messages if m["role"] != "system"]
    expected = "user" if prompt else "assistant"
    for i, role in enumerate(turns):
        if role != expected:
            return f"turn {i} is {role!r} where {expected!r} was expected: user and assistant turns must alternate"
        expected = "assistant" if expected == "user" else "user"
    if prompt and (not turns or turns[-1] != "user"):
        return "a prompt must end with a user turn"
    if not prompt and turns[-1] != "assistant":
        return "a response must end with an assistant turn"
    if not prompt and any(not m["content"].strip() for m in messages if m["role"] == "assistant"):
        return "an assistant turn is empty"
    return None


def split_shared_prefix(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen response, rejected response) of an implicit-prompt row.

    Conversations split at the first message where they differ; texts at the first character,
    moved back over one space so that the space starts the responses (TRL's rule)."""
    n = min(len(chosen), len(rejected))
    idx = next((i for i in range(n) if chosen[i] != rejected[i]), n)
    if isinstance(chosen, str) and idx > 0 and chosen[idx - 1] == " ":
        idx -= 1
    return chosen[:idx], chosen[idx:], rejected[idx:]


def to_explicit(rows: Sequence[Mapping[str, Any]]) -> Explicit:
    """Every row with an explicit `prompt`, in the format of the first row; raises
    `DataFormatError` at the first row that does not fit it."""
    if not rows:
        return Explicit([], "standard", False)
    first = rows[0]
    implicit = "prompt" not in first
    fmt: Format = "conversational" if is_conversation(first.get("chosen")) else "standard"
    out = []
    for i, row in enumerate(rows):
        missing = [c for c in (("chosen", "rejected") if implicit else ("prompt", "chosen", "rejected")) if c not in row]
        if missing:
            raise DataFormatError(i, missing[0], "missing" + (" (rows without a prompt need chosen and rejected)" if implicit else ""))
        if implicit and "prompt" in row:
            raise DataFormatError(i, "prompt", "present, but the first row has none: one file holds one format")
        row = dict(row)
        if implicit:
            row["prompt"], row["chosen"], row["rejected"] = _extract(i, row["chosen"], row["rejected"], fmt)
        _check_row(i, row, fmt)
        out.append(row)
    return Explicit(out, fmt, implicit)


def _extract(i: int, chosen: Any, rejected: Any, fmt: Format) -> tuple[Any, Any, Any]:
    for column, value in (("chosen", chosen), ("rejected", rejected)):
        if fmt == "conversational" and not is_conversation(value):
            raise DataFormatError(i, column, "must be a conversation, as in the first row")
        if fmt == "standard" and not isinstance(value, str):
            raise DataFormatError(i, column, f"must be a string, as in the first row, got {type(value).__name__}")
    prompt, chosen, rejected = split_shared_prefix(chosen, rejected)
    if not prompt or (isinstance(prompt, str) and not prompt.strip()):
        raise DataFormatError(i, "chosen", "shares no prompt with rejected: an implicit prompt must be a common prefix")
    if fmt == "conversational" and (not chosen or not rejected):
        raise DataFormatError(i, "chosen" if not chosen else "rejected", "is the shared prompt itself: it has no answer of its own")
    return list(prompt) if fmt == "conversational" else prompt, chosen, rejected


def _check_row(i: int, row: dict[str, Any], fmt: Format) -> None:
    if fmt == "standard":
        for column in ("prompt", "chosen", "rejected"):
            if not isinstance(row[column], str):
                raise DataFormatError(i, column, f"must be a string, as in the first row, got {type(row[column]).__name__}")
        return
    for column in ("prompt", "chosen", "rejected"):
        if problem := message_problem(row[column], prompt=column == "prompt"):
            raise DataFormatError(i, column, problem)


def as_conversational(row: Mapping[str, Any]) -> dict[str, Any]:
    """A standard row as a one-turn conversational row: the prompt becomes a user turn, each
    response (`chosen`, `rejected`, `completion`) an assistant turn; other columns are kept."""
    out = dict(row)
    out["prompt"] = [{"role": "user", "content": row["prompt"]}]
    for column in ("chosen", "rejected", "completion"):
        if column in row:
            out[column] = [{"role": "assistant", "content": row[column]}]
    return out
