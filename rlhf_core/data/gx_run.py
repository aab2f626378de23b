"""Running a list of checks as one Great Expectations suite over a data frame, and reading GX's
results back as `CheckResult`s a person can act on: the offending rows' file line numbers, a
few sample rows, the observed value against the expected one. What the checks are is
`rlhf_core.data.validation`'s business."""
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
from rlhf_core.data.schema import LINE_COLUMN
from rlhf_core.data.validation_report import CheckResult

# GX's INFO chatter (stores, data sources) is noise in pipeline logs; keep its warnings.
logging.getLogger("great_expectations").setLevel(logging.WARNING)

SAMPLE_CHARS = 80  # texts in offending-row samples are cut to this many characters
LISTED_LINES = 20  # offending line numbers kept per check (beyond sample_rows)


@dataclass(frozen=True)
class Check:
    """One expectation plus what a person needs to read its result."""

    name: str
    expectation: gxe.Expectation
    expected: str
    columns: tuple[str, ...] = ()  # data columns it reads; skipped when one is missing
    offending: str = ""  # row checks: what is wrong with an offending row, e.g. "chosen is null"
    show: tuple[str, ...] = ()  # columns shown in offending-row samples
    observe: Callable[[Any], str] = str  # table checks: GX observed_value -> text
    offending_rows: Callable[[pd.DataFrame], pd.Series] | None = None  # table checks: bool mask


def ephemeral_context():
    """An in-memory context: no files, no docs site, no progress bars on stderr."""
    config = DataContextConfig(
        store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False),
        progress_bars=ProgressBarsConfig(globally=False, metric_calculations=False),
        analytics_enabled=False,
    )
    return gx.get_context(mode="ephemeral", project_config=config)


def run_checks(context, dataset: str, frame: pd.DataFrame, checks: list[Check], cfg: ValidationConfig) -> list[CheckResult]:
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


def _check_result(check: Check, res: ExpectationValidationResult, frame: pd.DataFrame, dataset: str, cfg: ValidationConfig) -> CheckResult:
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
