"""Validate preference data against its contract with a Great Expectations suite.

`validate_preferences(df, cfg, eval_df)` builds an ephemeral GX context, runs one suite over
the preference rows (and a small one over the eval set when given) and returns a
`ValidationReport` (`rlhf_core.data.validation_report`): one `CheckResult` per expectation,
with the offending rows' file line numbers and a few sample rows, the columns outside the
contract, and how the file was read.

The checks, by stable name (`<col>` is prompt, chosen, rejected):

    <col>_column_present          ExpectColumnToExist
    row_count                     ExpectTableRowCountToBeBetween        >= min_rows
    <col>_not_null                ExpectColumnValuesToNotBeNull
    <col>_is_text                 ExpectColumnValuesToBeOfType(str)
    <col>_not_blank               ExpectColumnValuesToNotMatchRegex     whitespace-only
    <col>_length_in_range         ExpectColumnValueLengthsToBeBetween   [min_chars, max_chars]
    <col>_decodable               ExpectColumnValuesToNotMatchRegex     U+FFFD
    chosen_differs_from_rejected  ExpectSelectColumnValuesToBeUniqueWithinRecord
    no_duplicate_pairs            ExpectCompoundColumnsToBeUnique       (prompt, chosen, rejected)
    duplicate_prompt_share        ExpectColumnProportionOfUniqueValuesToBeBetween
    no_eval_leakage               ExpectColumnValuesToNotBeInSet        eval prompts
    eval_<col>_column_present, eval_<col>_not_null, eval_<col>_is_text, eval_<col>_not_blank
                                  the eval set's own `prompt` and `answer`

A check whose column is missing is skipped (listed in `report.skipped` with the reason),
never crashed on. Null values are reported only by `<col>_not_null`: the other row checks
ignore them, so one bad row fails one check.

Eval leakage compares prompts after collapsing runs of whitespace, so `"1+2= "` leaks `"1+2="`.
"""
from __future__ import annotations

import great_expectations.expectations as gxe
import pandas as pd

from rlhf_core.config import ValidationConfig
from rlhf_core.data.gx_run import Check, ephemeral_context, run_checks
from rlhf_core.data.schema import (
    EVAL_COLUMNS,
    LINE_COLUMN,
    OPTIONAL_PREFERENCE_COLUMNS,
    PREFERENCE_COLUMNS,
    READ_NOTES,
    REPLACEMENT_CHAR,
    prompt_key,
    replace_surrogates,
)
from rlhf_core.data.validation_report import CheckResult, ValidationReport

__all__ = ["CheckResult", "ValidationReport", "validate_preferences"]

# pyarrow-backed strings evaluate regexes with RE2, whose \s is ASCII-only: name the
# Unicode spaces explicitly so "\u00a0" or "\u3000" alone also counts as blank.
_BLANK = r"^[\s" + "\u00a0\u1680\u2000-\u200b\u2028\u2029\u202f\u205f\u3000\ufeff" + r"]*$"
_PROMPT_KEY = "_prompt_key"  # helper column: prompt with whitespace runs collapsed


def validate_preferences(
    df: pd.DataFrame, cfg: ValidationConfig, eval_df: pd.DataFrame | None = None
) -> ValidationReport:
    """Run the preference-data contract over `df` (and the eval set's own columns over `eval_df`).

    `df` is what `read_table` returns; without a `_line` column, rows are numbered from 1.
    """
    prefs = _prepare(df, PREFERENCE_COLUMNS)
    evals = _prepare(eval_df, EVAL_COLUMNS) if eval_df is not None else None

    leak_set, skipped = None, {}
    if evals is None:
        skipped["no_eval_leakage"] = "no eval set given"
    elif not cfg.check_eval_leakage:
        skipped["no_eval_leakage"] = "disabled by validation.check_eval_leakage"
    elif "prompt" not in evals:
        skipped["no_eval_leakage"] = "eval set has no 'prompt' column"
    else:
        leak_set = sorted(set(evals[_PROMPT_KEY].dropna()))

    context = ephemeral_context()
    checks, skipped_prefs = _preference_checks(prefs, cfg, leak_set)
    results = run_checks(context, "preferences", prefs, checks, cfg)
    skipped.update(skipped_prefs)
    if evals is not None:
        eval_checks, skipped_eval = _eval_checks(evals)
        results += run_checks(context, "eval", evals, eval_checks, cfg)
        skipped.update(skipped_eval)
    return ValidationReport(
        checks=results,
        num_rows=len(prefs),
        eval_rows=None if evals is None else len(evals),
        skipped=skipped,
        extra_columns=extra_columns(df),
        read_notes=list(df.attrs.get(READ_NOTES, [])),
    )


def extra_columns(df: pd.DataFrame) -> list[str]:
    """Columns of preference data outside the contract, in file order; training reads only
    the contract's columns, so these are reported, not used."""
    known = set(PREFERENCE_COLUMNS) | set(OPTIONAL_PREFERENCE_COLUMNS) | {LINE_COLUMN}
    return [str(c) for c in df.columns if c not in known]


# --- the suite -----------------------------------------------------------------------


def _presence_check(col: str, prefix: str = "") -> Check:
    return Check(
        f"{prefix}{col}_column_present",
        gxe.ExpectColumnToExist(column=col),
        f"column '{col}' present",
        (col,),
        f"column '{col}' is missing",
    )


def _text_checks(col: str, prefix: str = "") -> list[Check]:
    """Every value is a non-blank string (nulls are reported once, by `_not_null`)."""
    show = ("prompt",) if col == "prompt" else ("prompt", col)
    return [
        Check(
            f"{prefix}{col}_not_null",
            gxe.ExpectColumnValuesToNotBeNull(column=col),
            "no nulls",
            (col,),
            f"{col} is null",
            show,
        ),
        Check(
            f"{prefix}{col}_is_text",
            gxe.ExpectColumnValuesToBeOfType(column=col, type_="str"),
            "strings only",
            (col,),
            f"{col} is not a string",
            show,
            observe=lambda dtype: f"column dtype {dtype}",  # GX checks the dtype of non-object columns
        ),
        Check(
            f"{prefix}{col}_not_blank",
            gxe.ExpectColumnValuesToNotMatchRegex(column=col, regex=_BLANK),
            "no blank (whitespace-only) text",
            (col,),
            f"{col} is blank",
            show,
        ),
    ]


def _content_checks(col: str, cfg: ValidationConfig) -> list[Check]:
    show = ("prompt",) if col == "prompt" else ("prompt", col)
    bounds = f"[{cfg.min_chars}, {cfg.max_chars}]"
    return [
        Check(
            f"{col}_length_in_range",
            gxe.ExpectColumnValueLengthsToBeBetween(column=col, min_value=cfg.min_chars, max_value=cfg.max_chars),
            f"length in {bounds} chars",
            (col,),
            f"{col} length is outside {bounds} chars",
            show,
        ),
        Check(
            f"{col}_decodable",
            gxe.ExpectColumnValuesToNotMatchRegex(column=col, regex=REPLACEMENT_CHAR),
            "no undecodable text (U+FFFD)",
            (col,),
            f"{col} has undecodable text (U+FFFD)",
            show,
        ),
    ]


def _pair_checks(cfg: ValidationConfig, leak_set: list[str] | None) -> list[Check]:
    triple = ("prompt", "chosen", "rejected")
    max_share = cfg.max_duplicate_prompt_share
    checks = [
        Check(
            "chosen_differs_from_rejected",
            gxe.ExpectSelectColumnValuesToBeUniqueWithinRecord(
                column_list=["chosen", "rejected"], ignore_row_if="any_value_is_missing"
            ),
            "chosen != rejected in every row",
            ("chosen", "rejected"),
            "chosen == rejected",
            triple,
        ),
        Check(
            "no_duplicate_pairs",
            gxe.ExpectCompoundColumnsToBeUnique(column_list=list(triple), ignore_row_if="any_value_is_missing"),
            "no duplicate (prompt, chosen, rejected) triples",
            triple,
            "the (prompt, chosen, rejected) triple is duplicated",
            triple,
        ),
        Check(
            "duplicate_prompt_share",
            # share of rows repeating an earlier prompt = 1 - distinct prompts / rows
            gxe.ExpectColumnProportionOfUniqueValuesToBeBetween(column="prompt", min_value=1.0 - max_share),
            f"at most {max_share:.1%} of rows repeat an earlier prompt",
            ("prompt",),
            show=("prompt",),
            observe=lambda unique_share: f"{1.0 - unique_share:.1%} of rows repeat an earlier prompt",
            offending_rows=lambda f: f["prompt"].notna() & f["prompt"].duplicated(keep="first"),
        ),
    ]
    if leak_set is not None:
        checks.append(
            Check(
                "no_eval_leakage",
                gxe.ExpectColumnValuesToNotBeInSet(column=_PROMPT_KEY, value_set=leak_set),
                f"no prompt from the eval set ({len(leak_set)} prompts)",
                ("prompt",),
                "the prompt is in the eval set",
                ("prompt",),
            )
        )
    return checks


def _preference_checks(
    frame: pd.DataFrame, cfg: ValidationConfig, leak_set: list[str] | None
) -> tuple[list[Check], dict[str, str]]:
    checks = [_presence_check(c) for c in PREFERENCE_COLUMNS]
    checks.append(
        Check(
            "row_count",
            gxe.ExpectTableRowCountToBeBetween(min_value=cfg.min_rows),
            f"at least {cfg.min_rows} rows",
            observe=lambda n: f"{n} rows",
        )
    )
    for col in PREFERENCE_COLUMNS:
        checks += _text_checks(col) + _content_checks(col, cfg)
    checks += _pair_checks(cfg, leak_set)
    checks, skipped = _runnable(checks, frame)
    if len(frame) == 0 and any(c.name == "duplicate_prompt_share" for c in checks):
        checks = [c for c in checks if c.name != "duplicate_prompt_share"]
        skipped["duplicate_prompt_share"] = "no rows"  # GX reports 0% unique for an empty column
    return checks, skipped


def _eval_checks(frame: pd.DataFrame) -> tuple[list[Check], dict[str, str]]:
    checks = [_presence_check(c, prefix="eval_") for c in EVAL_COLUMNS]
    for col in EVAL_COLUMNS:
        checks += _text_checks(col, prefix="eval_")
    return _runnable(checks, frame)


def _runnable(checks: list[Check], frame: pd.DataFrame) -> tuple[list[Check], dict[str, str]]:
    """Split checks into those whose columns exist and the skipped ones, with the reason."""
    keep, skipped = [], {}
    for check in checks:
        missing = [c for c in check.columns if c not in frame]
        if missing and not isinstance(check.expectation, gxe.ExpectColumnToExist):
            noun = "column" if len(missing) == 1 else "columns"
            skipped[check.name] = f"{noun} {', '.join(repr(c) for c in missing)} missing"
        else:
            keep.append(check)
    return keep, skipped


# --- small helpers ---------------------------------------------------------------------


def _prepare(df: pd.DataFrame, columns: tuple[str, ...]) -> pd.DataFrame:
    """The frame GX sees: the contract's columns, `_line`, a positional index, helper columns."""
    frame = df[[c for c in columns if c in df.columns]].copy()
    frame[LINE_COLUMN] = df[LINE_COLUMN].to_numpy() if LINE_COLUMN in df else range(1, len(df) + 1)
    frame = frame.reset_index(drop=True)
    for col in columns:
        if col in frame and frame[col].dtype == object:
            frame[col] = frame[col].map(replace_surrogates)
    if "prompt" in frame:
        frame[_PROMPT_KEY] = frame["prompt"].map(prompt_key)
    return frame
