"""How a stage's outcome is recorded in the run summary."""
from __future__ import annotations

from pathlib import Path

import pytest

from tasks.data import DataValidationError
from tasks.tracking import run_stage


def test_a_failed_stage_records_its_error_and_the_report_that_explains_it(tmp_path):
    report = tmp_path / "validation_report.md"

    def failing():
        raise DataValidationError("prefs.jsonl: 1 data check(s) failed\nrow_count: 3 rows", report)

    stages: dict = {}
    with pytest.raises(DataValidationError):
        run_stage(stages, "validate", failing)
    assert stages == {"validate": {"status": "failed", "error": "prefs.jsonl: 1 data check(s) failed\nrow_count: 3 rows",
                                   "report": str(report)}}


def test_a_failure_without_a_report_records_the_error_only():
    stages: dict = {}
    with pytest.raises(RuntimeError):
        run_stage(stages, "sft", lambda: (_ for _ in ()).throw(RuntimeError("out of memory")))
    assert stages == {"sft": {"status": "failed", "error": "out of memory"}}


def test_a_data_validation_error_survives_pickling_with_its_report():
    import pickle

    exc = pickle.loads(pickle.dumps(DataValidationError("bad", Path("/r.md"))))
    assert (str(exc), exc.report_path) == ("bad", Path("/r.md"))
