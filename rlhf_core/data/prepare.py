"""The user's data, brought to the one shape every stage reads: text rendered by the chat template.

Preference pairs, the eval set, the SFT corpus and the RL prompt set may each come in any
format `rlhf_core.data.formats` reads (standard, conversational, implicit prompt) from any
source `rlhf_core.data.sources` reads. `prepare_inputs` checks them before anything trains:

- each row's format (known roles, turns that alternate, answers that end with a non-empty
  assistant turn, an implicit prompt that really is shared), naming the row and column;
- a chat template when the data is conversational, and that the template's prompts encode to
  the same ids in training as in vLLM's chat server (`rlhf_core.chat.check_rendering`);
- token lengths: a pair longer than `reward.max_length` is counted and then truncated, or
  rejected with its rows named (`reward.on_overlength`); a prompt whose tokens and
  `policy.max_new_tokens` exceed the model's context is rejected or left out (`data.on_overlength`).

It then writes each set as standard-format JSONL (prompt, chosen, rejected / prompt, answer /
prompt, completion) under the run's data directory, conversations rendered to the text the
policy sees, so that the data contract, SFT, the reward model, rollouts, evaluation and the
registry all read one kind of file. A standard-format local file that needs no change is
used where it is, so the validation report's line numbers stay the file's own.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rlhf_core.chat import check_rendering, render_prompt, render_response, require_chat_template
from rlhf_core.data.formats import DataFormatError as RowFormatError
from rlhf_core.data.formats import is_conversation, message_problem, to_explicit
from rlhf_core.data.schema import LINE_COLUMN, write_jsonl
from rlhf_core.data.sources import read_source

SHOWN_ROWS = 5
RENDER_CHECKED = 32  # prompts whose training and serving ids are compared


class InputError(ValueError):
    """Data that a run cannot use; the message names the file, the row and the fix."""


@dataclass(frozen=True)
class Limits:
    """Token limits of the run; None: not known yet (the demo's tokenizer is trained later)."""

    pair_tokens: int | None = None  # reward.max_length
    pair_on_overlength: Literal["truncate", "reject"] = "truncate"
    prompt_tokens: int | None = None  # the model's context minus policy.max_new_tokens
    prompt_on_overlength: Literal["reject", "drop"] = "reject"


@dataclass(frozen=True)
class PreparedFiles:
    preferences: Path
    eval: Path | None
    sft: Path | None
    prompts: Path | None
    conversational: bool
    notes: list[str] = field(default_factory=list)  # what was done to the data, for the report
    labelled: Path | None = None


@dataclass
class _Set:
    """One input set on its way to a file."""

    spec: str
    rows: list[dict[str, Any]]
    lines: list[int]
    changed: bool = False


def prepare_inputs(
    preferences: str | Path, eval_set: str | Path | None, sft: str | Path | None, prompts: str | Path | None,
    tokenizer, limits: Limits, out_dir: Path, labelled: str | Path | None = None,
) -> PreparedFiles:
    """Check and render the sets (see the module docstring); raises `InputError` on the first
    problem. `labelled` (answers rated desirable or not: prompt, completion, desirable) is
    rendered as the SFT corpus is."""
    notes: list[str] = []
    prefs = _read(preferences)
    try:
        explicit = to_explicit(prefs.rows)
    except RowFormatError as exc:
        raise _row_error(prefs, exc) from None
    conversational = explicit.format == "conversational"
    if explicit.implicit_prompt:
        notes.append(f"{preferences}: prompts extracted from the shared start of chosen and rejected")
    prefs.rows, prefs.changed = explicit.rows, explicit.implicit_prompt or conversational
    sets = {"eval": _read(eval_set), "sft": _read(sft), "prompts": _read(prompts), "labelled": _read(labelled)}
    conversational = conversational or any(
        s is not None and s.rows and is_conversation(s.rows[0].get("prompt", s.rows[0].get("messages")))
        for s in sets.values())
    if conversational:
        if tokenizer is None:
            raise InputError(f"{preferences}: conversational data needs a tokenizer with a chat template: set "
                             "`model.pretrained` (and `model.chat_template` if its tokenizer has none)")
        require_chat_template(tokenizer, str(preferences))
    if tokenizer is not None and conversational:
        check_rendering(tokenizer, [r["prompt"] for r in prefs.rows[:RENDER_CHECKED]], str(preferences))
    _render_pairs(prefs, tokenizer)
    for name in ("sft", "labelled"):
        if sets[name] is not None:
            _render_sft(sets[name], tokenizer)
    for name in ("eval", "prompts"):
        if sets[name] is not None:
            _render_prompts(sets[name], tokenizer)
    if tokenizer is not None:
        notes += _check_pair_lengths(prefs, tokenizer, limits)
        for name in ("eval", "prompts"):
            if sets[name] is not None:
                notes += _check_prompt_lengths(sets[name], tokenizer, limits)
    out_dir = Path(out_dir)
    written = {name: _write(s, out_dir / f"{name}.jsonl") for name, s in
               {"preferences": prefs, **sets}.items()}
    return PreparedFiles(written["preferences"], written["eval"], written["sft"], written["prompts"],
                         conversational, notes, written["labelled"])


def _read(spec: str | Path | None) -> _Set | None:
    if spec is None:
        return None
    df = read_source(spec)
    lines = [int(x) for x in df[LINE_COLUMN]]
    rows = [{k: _plain(v) for k, v in row.items() if k != LINE_COLUMN} for row in df.to_dict("records")]
    return _Set(str(spec), rows, lines)


def _plain(value: Any) -> Any:
    """Lists and dicts as Python has them (Parquet and `datasets` give numpy arrays)."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _where(s: _Set, row: int) -> str:
    return f"{s.spec}: row {row + 1} (line {s.lines[row]})" if row < len(s.lines) else s.spec


def _row_error(s: _Set, exc: RowFormatError) -> InputError:
    message = str(exc).split(": ", 1)[1] if ": " in str(exc) else str(exc)
    return InputError(f"{_where(s, exc.row)}, column {exc.column!r}: {message}")


def _render_pairs(s: _Set, tokenizer) -> None:
    if not s.rows or not is_conversation(s.rows[0]["prompt"]):
        return
    for row in s.rows:
        prompt = row["prompt"]
        row["chosen"] = render_response(tokenizer, prompt, row["chosen"])
        row["rejected"] = render_response(tokenizer, prompt, row["rejected"])
        row["prompt"] = render_prompt(tokenizer, prompt)


def _render_sft(s: _Set, tokenizer) -> None:
    """prompt/completion in text or messages, or one `messages` conversation (trained on its last
    assistant turn, the earlier turns being its prompt)."""
    for i, row in enumerate(s.rows):
        if "messages" in row and "prompt" not in row:
            messages = row.pop("messages")
            if not is_conversation(messages):
                raise InputError(f"{_where(s, i)}, column 'messages': must be a list of {{role, content}} messages")
            cut = max((j for j, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
            if cut is None:
                raise InputError(f"{_where(s, i)}, column 'messages': has no assistant turn to train on")
            row["prompt"], row["completion"] = messages[:cut], [messages[cut]]
            s.changed = True
        for column in ("prompt", "completion"):
            if column not in row:
                raise InputError(f"{_where(s, i)}: column {column!r} is missing (an SFT corpus has prompt and "
                                 "completion, or messages; labelled answers have prompt and completion)")
        if is_conversation(row["prompt"]):
            _check_messages(s, i, row, ("prompt", "completion"))
            row["completion"] = render_response(tokenizer, row["prompt"], row["completion"])
            row["prompt"] = render_prompt(tokenizer, row["prompt"])
            s.changed = True


def _render_prompts(s: _Set, tokenizer) -> None:
    for i, row in enumerate(s.rows):
        if "prompt" not in row:
            raise InputError(f"{_where(s, i)}: column 'prompt' is missing")
        if is_conversation(row["prompt"]):
            _check_messages(s, i, row, ("prompt",))
            row["prompt"] = render_prompt(tokenizer, row["prompt"])
            s.changed = True
        elif not isinstance(row["prompt"], str):
            raise InputError(f"{_where(s, i)}, column 'prompt': must be text or a list of messages")


def _check_messages(s: _Set, i: int, row: dict, columns: Sequence[str]) -> None:
    for column in columns:
        if problem := message_problem(row[column], prompt=column == "prompt"):
            raise InputError(f"{_where(s, i)}, column {column!r}: {problem}")


def _check_pair_lengths(s: _Set, tokenizer, limits: Limits) -> list[str]:
    from rlhf_core.data.pairs import encode_pair_text  # noqa: PLC0415 - torch only when lengths are checked

    if limits.pair_tokens is None:
        return []
    over = [i for i, r in enumerate(s.rows)
            if max(len(encode_pair_text(tokenizer, r["prompt"], r[c])) for c in ("chosen", "rejected"))
            > limits.pair_tokens]
    return _over_limit(s, over, f"prompt + response longer than reward.max_length={limits.pair_tokens} tokens",
                       limits.pair_on_overlength == "reject", "truncated to it", "reward.on_overlength")


def _check_prompt_lengths(s: _Set, tokenizer, limits: Limits) -> list[str]:
    if limits.prompt_tokens is None:
        return []
    over = [i for i, r in enumerate(s.rows) if len(tokenizer(r["prompt"])["input_ids"]) > limits.prompt_tokens]
    notes = _over_limit(s, over, f"a prompt longer than {limits.prompt_tokens} tokens (the context less "
                        "policy.max_new_tokens)", limits.prompt_on_overlength == "reject", "left out",
                        "data.on_overlength")
    if over:
        dropped = set(over)
        s.rows = [r for i, r in enumerate(s.rows) if i not in dropped]
        s.lines = [n for i, n in enumerate(s.lines) if i not in dropped]
        s.changed = True
    return notes


def _over_limit(s: _Set, over: list[int], what: str, reject: bool, fate: str, setting: str) -> list[str]:
    if not over:
        return []
    shown = ", ".join(str(s.lines[i]) for i in over[:SHOWN_ROWS]) + (" ..." if len(over) > SHOWN_ROWS else "")
    head = f"{s.spec}: {len(over)} of {len(s.rows)} rows have {what} (lines {shown})"
    if reject:
        raise InputError(f"{head}; {setting} is reject. Shorten them, raise the limit, or set {setting} to "
                         f"{'drop' if setting.startswith('data') else 'truncate'}")
    return [f"{head}: {fate}"]


def _write(s: _Set | None, path: Path) -> Path | None:
    if s is None:
        return None
    source = Path(s.spec)
    if not s.changed and source.is_file():
        return source
    return write_jsonl(s.rows, path)
