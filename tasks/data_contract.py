"""The preference-data contract on files, with no Prefect or MLflow: read them, run the
Great Expectations suite, write the report. `rlhf validate` calls `check_files` directly (its
answer then takes about as long as Great Expectations does); the pipeline's validate task
(`tasks.data`) runs the same contract, cached and recorded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.config import ValidationConfig
from rlhf_core.data.schema import DataFormatError, fingerprint, read_table
from rlhf_core.data.validation import ValidationReport, validate_preferences

__all__ = ["DataFormatError", "DataPaths", "DataValidationError", "ValidatedData", "check_files", "contract",
           "failure", "write_report"]


class DataValidationError(RuntimeError):
    """Preference data broke the contract; training must not start. `report_path` is the
    validation report that lists every check and the offending rows."""

    def __init__(self, message: str, report_path: Path):
        super().__init__(message)
        self.report_path = report_path

    def __reduce__(self):  # Prefect may pickle a task's exception with its state
        return type(self), (str(self), self.report_path)


@dataclass(frozen=True)
class DataPaths:
    preferences: Path
    eval: Path | None
    sft: Path | None  # None: SFT on the preference data's chosen responses
    generated: bool
    prompts: Path | None = None  # the RL prompt set; None: the SFT and preference prompts
    notes: tuple[str, ...] = ()  # what preparing the data did to it (rows truncated or left out)

    def summary(self) -> dict:
        return {"status": "prepared", "preferences": str(self.preferences), "notes": list(self.notes)}


@dataclass(frozen=True)
class ValidatedData:
    paths: DataPaths
    fingerprint: str
    num_rows: int
    report_path: Path

    def summary(self) -> dict:
        return {"status": "passed", "rows": self.num_rows, "dataset_fingerprint": self.fingerprint,
                "report": str(self.report_path)}


def write_report(report: ValidationReport, out_dir: Path) -> Path:
    """`validation_report.json` and `validation_report.md` in `out_dir`; returns the JSON's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "validation_report.json"
    path.write_text(json.dumps(report.to_dict(), indent=2, default=str) + "\n")
    (out_dir / "validation_report.md").write_text(report.to_markdown())
    return path


def contract(paths: DataPaths, cfg: ValidationConfig) -> ValidationReport:
    """The expectations' verdict on the files (no caching, no recording)."""
    prefs = read_table(paths.preferences)
    evals = read_table(paths.eval) if paths.eval is not None else None
    return validate_preferences(prefs, cfg, eval_df=evals)


def failure(paths: DataPaths, report: ValidationReport, out_dir: Path) -> DataValidationError:
    """The error a failed contract raises: every failed check with its lines, and the report."""
    return DataValidationError(
        f"{paths.preferences}: {len(report.failed)} data check(s) failed\n" + report.failure_message(),
        out_dir / "validation_report.md",
    )


def check_files(paths: DataPaths, cfg: ValidationConfig, out_dir: Path) -> ValidatedData:
    """Run the contract on the files and write its report under `out_dir`, without Prefect or
    MLflow: what `rlhf validate` does, in about the time Great Expectations needs. Raises
    `DataValidationError` when a check fails."""
    data_fp = fingerprint([p for p in (paths.preferences, paths.eval) if p is not None])
    report = contract(paths, cfg)
    report_path = write_report(report, out_dir)
    if not report.success:
        raise failure(paths, report, out_dir)
    return ValidatedData(paths, data_fp, report.num_rows, report_path)
