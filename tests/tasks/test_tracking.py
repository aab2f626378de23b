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


def test_runs_left_running_by_a_dead_process_are_closed_as_killed_and_no_others(tmp_path):
    import socket
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    from rlhf_core.process_owner import this_process
    from tasks.tracking import OWNER_TAG, close_abandoned_runs

    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    exp = client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = f"{socket.gethostname()}:{gone.stdout.strip()}:12345"
    runs = {name: client.create_run(exp, run_name=name, tags=tags).info.run_id for name, tags in {
        "dead": {OWNER_TAG: dead}, "alive": {OWNER_TAG: this_process()},
        "elsewhere": {OWNER_TAG: "another-host:1:1"}, "unknown": {}, "finished": {OWNER_TAG: dead}}.items()}
    client.set_terminated(runs["finished"], "FINISHED")

    assert close_abandoned_runs(client, exp) == [runs["dead"]]
    status = {name: client.get_run(run_id).info.status for name, run_id in runs.items()}
    assert status == {"dead": "KILLED", "alive": "RUNNING", "elsewhere": "RUNNING", "unknown": "RUNNING",
                      "finished": "FINISHED"}
    assert "ended without closing it" in client.get_run(runs["dead"]).data.tags["failure_reason"]
    assert close_abandoned_runs(client, exp) == []
