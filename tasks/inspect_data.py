"""`rlhf validate --show N`: the first rows of a preference file as the trainer will see them
(`rlhf_core.data.preview`), under the run's tokenizer, as text for the terminal.

The tokenizer is `model.pretrained`'s (with `model.chat_template` when set), as `prepare_files`
loads it; without a pretrained model, one trained on the file's texts with
`tokenizer.vocab_size`, as the demo's SFT stage trains its own (on the SFT corpus too, so a
run's counts may differ by a token or so).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from rlhf_core.config import PipelineConfig, RewardConfig
from rlhf_core.data.formats import to_explicit
from rlhf_core.data.preview import AnswerView, RowView, preview_rows
from rlhf_core.data.schema import LINE_COLUMN
from rlhf_core.data.sources import read_source

INDENT = "    | "
CUT_SHOWN_CHARS = 60


def show_rows(cfg: PipelineConfig, spec: str | Path, n: int) -> str:
    """The first `n` rows of `spec` as `rlhf validate --show` prints them. Rows that cannot be
    shown give one line saying why: the validation that follows names the row and the fix."""
    try:
        df = read_source(spec)
        explicit = to_explicit(plain_rows(df.head(n)))
        if explicit.format == "conversational" and cfg.model.pretrained is None:
            raise ValueError("conversational data is rendered by a chat template: set model.pretrained "
                             "(e.g. --set model.pretrained=DIR)")
        tokenizer, which = run_tokenizer_for(cfg, df)
        lines = [int(x) for x in df[LINE_COLUMN].head(n)]
        views = preview_rows(explicit.rows, tokenizer, cfg.reward.max_length, lines)
    except (ValueError, OSError) as exc:  # DataFormatError, ChatTemplateError are ValueErrors
        return f"cannot show the rows of {spec}: {exc}"
    return format_rows(views, cfg.reward, f"{len(views)} of {len(df)} rows of {spec}", which)


def plain_rows(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows as plain Python values (Parquet's and `datasets`' arrays as lists), without the line column."""
    return json.loads(df.drop(columns=[LINE_COLUMN]).to_json(orient="records", force_ascii=False))


def run_tokenizer_for(cfg: PipelineConfig, df: pd.DataFrame):
    """(the tokenizer a run of `cfg` encodes the rows of `df` with, which one it is in words)."""
    if cfg.model.pretrained is not None:
        from rlhf_core.chat import read_chat_template  # noqa: PLC0415 - transformers only when asked
        from rlhf_core.models.pretrained import run_tokenizer  # noqa: PLC0415

        template = read_chat_template(cfg.model.chat_template) if cfg.model.chat_template else None
        which = f"the tokenizer of model.pretrained={cfg.model.pretrained}"
        return run_tokenizer(cfg.model.pretrained, template), which
    from rlhf_core.tokenizer import train_tokenizer  # noqa: PLC0415

    prompts = df["prompt"] if "prompt" in df else [""] * len(df)  # implicit prompt: whole texts
    texts = [p + a for column in ("chosen", "rejected") if column in df
             for p, a in zip(prompts, df[column]) if isinstance(p, str) and isinstance(a, str)]
    which = (f"trained on this file's texts with tokenizer.vocab_size={cfg.tokenizer.vocab_size}, as the demo's "
             "SFT stage trains one")
    return train_tokenizer(texts, cfg.tokenizer.vocab_size), which


def format_rows(views: Sequence[RowView], reward: RewardConfig, what: str, tokenizer: str) -> str:
    """The rows as a block of text: each text verbatim after `INDENT`, its token counts above it."""
    out = [f"{what}, as the trainer sees them", f"tokenizer: {tokenizer}",
           f"reward.max_length={reward.max_length} (reward.on_overlength={reward.on_overlength})"]
    if reward.base_model is not None:
        out.append(f"reward.base_model={reward.base_model}: its tokenizer may count the scored tokens differently")
    for i, view in enumerate(views, 1):
        out += ["", f"row {i}" + (f" (line {view.line})" if view.line is not None else "")
                + (": rendered by the chat template" if view.conversational else ""),
                f"  prompt: {view.prompt_tokens} tokens" + (
                    f", reward.max_length={reward.max_length} or more: the reward model sees none of the answers"
                    if view.prompt_tokens >= reward.max_length else ""), *_verbatim(view.prompt)]
        for name, answer in (("chosen", view.chosen), ("rejected", view.rejected)):
            out += [f"  {name}: {_counts(answer, reward)}", *_verbatim(answer.text)]
    cut = sum(v.truncated for v in views)
    out += ["", f"{cut} of {len(views)} rows shown are longer than reward.max_length={reward.max_length}"]
    return "\n".join(out)


def _counts(answer: AnswerView, reward: RewardConfig) -> str:
    head = f"{answer.tokens} tokens, {answer.scored_tokens} scored with the prompt"
    if not answer.cut_tokens:
        return f"{head}, within reward.max_length={reward.max_length}"
    cut = _clipped(answer.cut_text)
    if reward.on_overlength == "truncate":
        return f"{head}, {answer.cut_tokens} cut at reward.max_length={reward.max_length}: {cut}"
    return (f"{head}, {answer.cut_tokens} past reward.max_length={reward.max_length}, which "
            f"reward.on_overlength=reject refuses: {cut}")


def _clipped(text: str) -> str:
    """The start of a cut tail, quoted (escapes visible): where the cut falls is what matters."""
    return repr(text) if len(text) <= CUT_SHOWN_CHARS else f"{text[:CUT_SHOWN_CHARS]!r}..."


def _verbatim(text: str) -> list[str]:
    return [INDENT + line for line in text.split("\n")]
