"""How a stage's outcome is recorded in the run summary."""
from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from tasks.data import DataValidationError
from tasks.summary import record_stage


def test_a_failed_stage_records_its_error_and_the_report_that_explains_it(tmp_path):
    report = tmp_path / "validation_report.md"

    def failing():
        raise DataValidationError("prefs.jsonl: 1 data check(s) failed\nrow_count: 3 rows", report)

    stages: dict = {}
    with pytest.raises(DataValidationError):
        record_stage(stages, "validate", failing)
    assert stages == {"validate": {"status": "failed", "error": "prefs.jsonl: 1 data check(s) failed\nrow_count: 3 rows",
                                   "report": str(report)}}


def test_a_failure_without_a_report_records_the_error_only():
    stages: dict = {}
    with pytest.raises(RuntimeError):
        record_stage(stages, "sft", lambda: (_ for _ in ()).throw(RuntimeError("out of memory")))
    assert stages == {"sft": {"status": "failed", "error": "out of memory"}}


def test_a_data_validation_error_survives_pickling_with_its_report():
    import pickle

    exc = pickle.loads(pickle.dumps(DataValidationError("bad", Path("/r.md"))))
    assert (str(exc), exc.report_path) == ("bad", Path("/r.md"))


def test_runs_left_running_by_a_dead_process_are_closed_as_killed_and_no_others(tmp_path, mlflow_store):
    import socket
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    from rlhf_core.process_owner import this_process
    from tasks.run_start import close_abandoned_runs
    from tasks.tracking import OWNER_TAG

    client = MlflowClient(mlflow_store)
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


# -- resuming a run ---------------------------------------------------------------------------

class _Result:
    def __init__(self, path: Path, figure: int):
        self.path, self.figure = path, figure

    def summary(self) -> dict:
        return {"status": "completed", "figure": self.figure}


def test_a_journalled_stage_is_reused_not_run_again_while_its_files_exist(tmp_path):
    from tasks.journal import Stages

    model = tmp_path / "model"
    model.mkdir()
    calls = []

    def train(figure):
        calls.append(figure)
        return _Result(model, figure)

    first = Stages(tmp_path / "stages")
    assert record_stage(first, "sft", train, 1).figure == 1
    assert [p.name for p in (tmp_path / "stages").iterdir()] == ["train.pkl"]  # whole, no temporary left

    again = Stages(tmp_path / "stages")  # the rerun of the run
    assert record_stage(again, "sft", train, 2).figure == 1 and calls == [1]
    assert again["sft"] == {"status": "completed", "figure": 1, "reused": True}

    model.rmdir()  # its files are gone: it runs again
    rerun = Stages(tmp_path / "stages")
    assert record_stage(rerun, "sft", train, 3).figure == 3 and calls == [1, 3]
    assert rerun["sft"] == {"status": "completed", "figure": 3}


def test_a_failed_stage_is_not_journalled(tmp_path):
    from tasks.journal import Stages

    stages = Stages(tmp_path / "stages")
    with pytest.raises(RuntimeError):
        record_stage(stages, "sft", lambda: (_ for _ in ()).throw(RuntimeError("out of memory")))
    assert not (tmp_path / "stages").exists()


@pytest.fixture
def store(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_store)
    return client, client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())


def test_resume_is_refused_with_the_reason_for_runs_it_cannot_continue(store):
    import subprocess
    import sys

    from rlhf_core.process_owner import this_process
    from tasks.run_start import ResumeRefused, resumable_run
    from tasks.tracking import OWNER_TAG

    client, exp = store
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = f"{socket.gethostname()}:{gone.stdout.strip()}:12345"

    def parent(status: str, owner: str, **tags) -> str:
        run_id = client.create_run(exp, tags={"pipeline": "rlhf-pipeline", OWNER_TAG: owner, **tags}).info.run_id
        if status != "RUNNING":
            client.set_terminated(run_id, status)
        return run_id

    for run_id, reason in [
        ("0" * 32, "no such run"),
        (parent("FINISHED", dead, outcome="rejected"), "it finished (rejected); there is nothing to continue"),
        (parent("RUNNING", this_process()), "it is still running (process " + this_process()),
        (parent("FAILED", dead, **{"mlflow.parentRunId": "p1", "stage": "sft"}),
         "it is the run of a stage (sft); resume its pipeline run, p1"),
        (parent("FAILED", dead, pipeline="evaluate"), "it is not an rlhf-pipeline run (its pipeline tag: evaluate)"),
    ]:
        with pytest.raises(ResumeRefused, match=re.escape(reason)):
            resumable_run(client, run_id)
    for status, owner in (("FAILED", dead), ("KILLED", dead), ("RUNNING", dead)):  # a dead owner's RUNNING run too
        run_id = parent(status, owner)
        assert resumable_run(client, run_id).info.run_id == run_id


def test_a_retried_prefect_flow_run_continues_the_run_it_opened_and_only_a_failed_one(store, tmp_path):
    from tasks.run_start import FLOW_RUN_TAG, _reopen, _run_to_resume

    client, exp = store
    failed = client.create_run(exp, tags={"pipeline": "rlhf-pipeline", FLOW_RUN_TAG: "flow-1",
                                          "output_dir": str(tmp_path), "failure_reason": "out of memory"}).info.run_id
    client.set_terminated(failed, "FAILED")
    done = client.create_run(exp, tags={"pipeline": "rlhf-pipeline", FLOW_RUN_TAG: "flow-2"}).info.run_id
    client.set_terminated(done, "FINISHED")

    assert _run_to_resume(client, exp, "rlhf-pipeline", None, "flow-2") is None  # finished: a new run
    assert _run_to_resume(client, exp, "rlhf-pipeline", None, "flow-3") is None  # never opened one
    assert _run_to_resume(client, exp, "rlhf-pipeline", None, None) is None  # not in a flow run
    previous = _run_to_resume(client, exp, "rlhf-pipeline", None, "flow-1")
    assert previous.info.run_id == failed

    from prefect.logging import disable_run_logger

    with disable_run_logger():
        reopened = _reopen(client, previous)
    assert (reopened.run_id, reopened.out_dir) == (failed, tmp_path)
    run = client.get_run(failed)
    assert run.info.status == "RUNNING" and "failure_reason" not in run.data.tags
    assert run.data.tags["resume.count"] == "1" and run.data.tags["resume.previous"] == "FAILED: out of memory"


def test_one_process_at_a_time_holds_a_run(tmp_path):
    """Two resumes of one run started together: the second is refused until the first ends."""
    from tasks.run_start import hold_run_dir, release_run_dir

    import subprocess
    import sys

    hold = ("import sys; from pathlib import Path; from tasks.run_start import hold_run_dir; "
            "hold_run_dir(Path(sys.argv[1]), 'r1')")
    hold_run_dir(tmp_path, "r1")
    hold_run_dir(tmp_path, "r1")  # this process already holds it: a retried start goes on
    other = subprocess.run([sys.executable, "-c", hold, str(tmp_path)], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parents[2])
    assert other.returncode == 1
    assert f"cannot resume r1: another process is running it now ({tmp_path / 'run.lock'} is locked)" in other.stderr
    release_run_dir(tmp_path)
    assert subprocess.run([sys.executable, "-c", hold, str(tmp_path)], cwd=Path(__file__).resolve().parents[2]).returncode == 0

