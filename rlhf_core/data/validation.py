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

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import great_expectations as gx
import great_expectations.expectations as gxe
import pandas as pd
from great_expectations.core import ExpectationValidationResult
from great_expectations.data_context.types.base import (
    DataContextConfig,
    InMemoryStoreBackendDefaults,
    ProgressBarsConfig,
)

from rlhf_core.config import ValidationConfig
from rlhf_core.data.schema import (
    EVAL_COLUMNS,
    LINE_COLUMN,
    OPTIONAL_PREFERENCE_COLUMNS,
    PREFERENCE_COLUMNS,
    READ_NOTES,
    REPLACEMENT_CHAR,
    replace_surrogates,
)
from rlhf_core.data.validation_report import CheckResult, ValidationReport

__all__ = ["CheckResult", "ValidationReport", "validate_preferences"]

# GX's INFO chatter (stores, data sources) is noise in pipeline logs; keep its warnings.
logging.getLogger("great_expectations").setLevel(logging.WARNING)

SAMPLE_CHARS = 80  # texts in offending-row samples are cut to this many characters
LISTED_LINES = 20  # offending line numbers kept per check (beyond sample_rows)

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

    context = _ephemeral_context()
    checks, skipped_prefs = _preference_checks(prefs, cfg, leak_set)
    results = _run(context, "preferences", prefs, checks, cfg)
    skipped.update(skipped_prefs)
    if evals is not None:
        eval_checks, skipped_eval = _eval_checks(evals)
        results += _run(context, "eval", evals, eval_checks, cfg)
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


@dataclass(frozen=True)
class _Check:
    """One expectation plus what a person needs to read its result."""

    name: str
    expectation: gxe.Expectation
    expected: str
    columns: tuple[str, ...] = ()  # data columns it reads; skipped when one is missing
    offending: str = ""  # row checks: what is wrong with an offending row, e.g. "chosen is null"
    show: tuple[str, ...] = ()  # columns shown in offending-row samples
    observe: Callable[[Any], str] = str  # table checks: GX observed_value -> text
    offending_rows: Callable[[pd.DataFrame], pd.Series] | None = None  # table checks: bool mask


def _presence_check(col: str, prefix: str = "") -> _Check:
    return _Check(
        f"{prefix}{col}_column_present",
        gxe.ExpectColumnToExist(column=col),
        f"column '{col}' present",
        (col,),
        f"column '{col}' is missing",
    )


def _text_checks(col: str, prefix: str = "") -> list[_Check]:
    """Every value is a non-blank string (nulls are reported once, by `_not_null`)."""
    show = ("prompt",) if col == "prompt" else ("prompt", col)
    return [
        _Check(
            f"{prefix}{col}_not_null",
            gxe.ExpectColumnValuesToNotBeNull(column=col),
            "no nulls",
            (col,),
            f"{col} is null",
            show,
        ),
        _Check(
            f"{prefix}{col}_is_text",
            gxe.ExpectColumnValuesToBeOfType(column=col, type_="str"),
            "strings only",
            (col,),
            f"{col} is not a string",
            show,
            observe=lambda dtype: f"column dtype {dtype}",  # GX checks the dtype of non-object columns
        ),
        _Check(
            f"{prefix}{col}_not_blank",
            gxe.ExpectColumnValuesToNotMatchRegex(column=col, regex=_BLANK),
            "no blank (whitespace-only) text",
            (col,),
            f"{col} is blank",
            show,
        ),
    ]


def _content_checks(col: str, cfg: ValidationConfig) -> list[_Check]:
    show = ("prompt",) if col == "prompt" else ("prompt", col)
    bounds = f"[{cfg.min_chars}, {cfg.max_chars}]"
    return [
        _Check(
            f"{col}_length_in_range",
            gxe.ExpectColumnValueLengthsToBeBetween(column=col, min_value=cfg.min_chars, max_value=cfg.max_chars),
            f"length in {bounds} chars",
            (col,),
            f"{col} length is outside {bounds} chars",
            show,
        ),
        _Check(
            f"{col}_decodable",
            gxe.ExpectColumnValuesToNotMatchRegex(column=col, regex=REPLACEMENT_CHAR),
            "no undecodable text (U+FFFD)",
            (col,),
            f"{col} has undecodable text (U+FFFD)",
            show,
        ),
    ]


def _pair_checks(cfg: ValidationConfig, leak_set: list[str] | None) -> list[_Check]:
    triple = ("prompt", "chosen", "rejected")
    max_share = cfg.max_duplicate_prompt_share
    checks = [
        _Check(
            "chosen_differs_from_rejected",
            gxe.ExpectSelectColumnValuesToBeUniqueWithinRecord(
                column_list=["chosen", "rejected"], ignore_row_if="any_value_is_missing"
            ),
            "chosen != rejected in every row",
            ("chosen", "rejected"),
            "chosen == rejected",
            triple,
        ),
        _Check(
            "no_duplicate_pairs",
            gxe.ExpectCompoundColumnsToBeUnique(column_list=list(triple), ignore_row_if="any_value_is_missing"),
            "no duplicate (prompt, chosen, rejected) triples",
            triple,
            "the (prompt, chosen, rejected) triple is duplicated",
            triple,
        ),
        _Check(
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
            _Check(
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
) -> tuple[list[_Check], dict[str, str]]:
    checks = [_presence_check(c) for c in PREFERENCE_COLUMNS]
    checks.append(
        _Check(
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


def _eval_checks(frame: pd.DataFrame) -> tuple[list[_Check], dict[str, str]]:
    checks = [_presence_check(c, prefix="eval_") for c in EVAL_COLUMNS]
    for col in EVAL_COLUMNS:
        checks += _text_checks(col, prefix="eval_")
    return _runnable(checks, frame)


def _runnable(checks: list[_Check], frame: pd.DataFrame) -> tuple[list[_Check], dict[str, str]]:
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


# --- running GX and reading its results ------------------------------------------------


def _ephemeral_context():
    """An in-memory context: no files, no docs site, no progress bars on stderr."""
    config = DataContextConfig(
        store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False),
        progress_bars=ProgressBarsConfig(globally=False, metric_calculations=False),
        analytics_enabled=False,
    )
    return gx.get_context(mode="ephemeral", project_config=config)


def _run(context, dataset: str, frame: pd.DataFrame, checks: list[_Check], cfg: ValidationConfig) -> list[CheckResult]:
    batch = (
        context.data_sources.add_pandas(name=dataset)
        .add_dataframe_asset(name=dataset)
        .add_batch_definition_whole_dataframe(name="all_rows")
        .get_batch(batch_parameters={"dataframe": frame})
    )
    suite = gx.ExpectationSuite(name=f"{dataset}_contract")
    for check in checks:
        check.expectation.meta = {"check": check.name}  # carried into the result, see below
        suite.add_expectation(check.expectation)
    result_format = {"result_format": "SUMMARY", "partial_unexpected_count": max(cfg.sample_rows, LISTED_LINES)}
    validation = batch.validate(suite, result_format=result_format)
    # GX does not keep suite order in its results; match them back by the name in `meta`.
    by_name = {r.expectation_config.meta["check"]: r for r in validation.results}
    return [_check_result(c, by_name[c.name], frame, dataset, cfg) for c in checks]


def _check_result(check: _Check, res: ExpectationValidationResult, frame: pd.DataFrame, dataset: str, cfg: ValidationConfig) -> CheckResult:
    result = dict(res.result or {})
    out = CheckResult(
        name=check.name,
        expectation=res.expectation_config.type,
        column=", ".join(check.columns) or None,
        success=bool(res.success),
        expected=check.expected,
        observed="",
        dataset=dataset,
    )
    info = res.exception_info or {}
    if info.get("raised_exception"):
        out.success = False
        out.observed = f"error: {info.get('exception_message')}"
        out.problem = f"could not be evaluated: {info.get('exception_message')}"
        return out

    total = len(frame)
    if "unexpected_count" in result:  # a row-level (map) expectation
        n = int(result["unexpected_count"])
        index = list(result.get("partial_unexpected_index_list") or [])
        out.unexpected_count = n
        out.observed = _share(n, total)
        if n:
            out.problem = f"{_rows(n)} where {check.offending}"
    else:  # a table-level expectation: one observed value, offending rows only if we can name them
        if "observed_value" in result:
            out.observed = check.observe(result["observed_value"])
            out.problem = "" if out.success else f"{out.observed}, expected {check.expected}"
        else:  # ExpectColumnToExist reports nothing but success
            out.observed = "present" if out.success else "missing"
            out.problem = "" if out.success else check.offending
        index = []
        if check.offending_rows is not None and not out.success:
            mask = check.offending_rows(frame)
            out.unexpected_count = int(mask.sum())
            index = list(frame.index[mask][: max(cfg.sample_rows, LISTED_LINES)])
    if not out.success:
        out.lines = [int(frame.at[i, LINE_COLUMN]) for i in index]
        out.sample = [_sample_row(frame, i, check.show) for i in index[: cfg.sample_rows]]
    return out


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


def prompt_key(prompt: Any) -> str | None:
    """A text prompt with its runs of whitespace collapsed, as the leakage check compares
    prompts; None for anything else."""
    return " ".join(prompt.split()) if isinstance(prompt, str) else None


def _sample_row(frame: pd.DataFrame, index: int, columns: tuple[str, ...]) -> dict[str, Any]:
    row: dict[str, Any] = {LINE_COLUMN: int(frame.at[index, LINE_COLUMN])}
    for col in columns:
        if col in frame:
            row[col] = _jsonable(frame.at[index, col])
    return row


def _jsonable(value: Any) -> Any:
    """A cell as plain JSON: None for any missing value, long texts cut to SAMPLE_CHARS."""
    if hasattr(value, "item"):  # numpy scalar
        value = value.item()
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, (bool, int, float)):
        return value
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= SAMPLE_CHARS else text[: SAMPLE_CHARS - 1] + "…"


def _share(n: int, total: int) -> str:
    """'3 of 500 rows (0.6%)'; a nonzero share never rounds to 0.0%."""
    if n == 0 or total == 0:
        return f"{n} of {total} rows"
    pct = 100.0 * n / total
    return f"{n} of {total} rows ({'<0.1' if pct < 0.1 else f'{pct:.1f}'}%)"


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"
