"""The run report as the pipeline writes it: gathered from a real MLflow store (SQLite), written
beside summary.json, attached to the parent run, and never the reason a run fails."""
from __future__ import annotations

import json
import logging

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from tasks.run_report import policy_curves, write_run_report
from tasks.summary import finish_pipeline_run
from tasks.tracking import PipelineRun


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One SQLite store for the module (creating one takes seconds); an experiment per test."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def run(store, tmp_path, request) -> PipelineRun:
    client = MlflowClient(store)
    exp = client.create_experiment(request.node.name, artifact_location=(tmp_path / "mlartifacts").as_uri())
    parent = client.create_run(exp, run_name="demo").info.run_id
    out_dir = tmp_path / "runs" / "demo"
    out_dir.mkdir(parents=True)
    return PipelineRun(store, exp, parent, out_dir)


def stage_run(run: PipelineRun, stage: str, metrics: dict[str, list[tuple[int, float]]]) -> str:
    client = run.client
    stage_id = client.create_run(run.experiment_id, run_name=stage,
                                 tags={"mlflow.parentRunId": run.run_id, "stage": stage}).info.run_id
    client.log_batch(stage_id, metrics=[Metric(k, v, 0, s) for k, points in metrics.items() for s, v in points])
    client.set_terminated(stage_id)
    return stage_id


def summary_of(run: PipelineRun, status: str = "completed") -> dict:
    return {"pipeline": "rlhf-pipeline", "mlflow_run_id": run.run_id, "output_dir": str(run.out_dir),
            "status": status, "stages": {"policy": {"status": "completed", "algorithm": "grpo", "seconds": 9.5}}}


def test_the_curves_come_from_every_policy_attempt_the_later_one_winning(run):
    stage_run(run, "reward", {"policy/kl": [(1, 9.0)]})  # another stage's metric of the same name: not read
    stage_run(run, "policy", {"policy/kl": [(1, 0.1), (2, 0.2), (3, 0.3)], "policy/entropy": [(1, 1.0)]})
    stage_run(run, "policy", {"policy/kl": [(3, 0.35), (4, 0.4)], "eval/accuracy": [(4, 0.9)]})  # resumed at 2
    assert policy_curves(run.client, run.experiment_id, run.run_id) == {
        "policy/kl": [(1, 0.1), (2, 0.2), (3, 0.35), (4, 0.4)], "eval/accuracy": [(4, 0.9)]}


def test_the_report_is_written_beside_the_summary_and_attached_to_the_parent_run(run):
    stage_run(run, "policy", {"policy/kl": [(1, 0.1), (2, 0.2)], "policy/rm_score_mean": [(1, 0.0), (2, 0.5)]})
    (run.out_dir / "gate_report.json").write_text(json.dumps(
        {"decision": {"status": "passed", "checks": [{"name": "win_rate_vs_reference", "passed": True,
                                                      "observed": 0.79, "threshold": 0.5, "op": ">=",
                                                      "low": 0.7575, "high": 0.825}]}}))
    summary = summary_of(run)
    finish_pipeline_run.fn(run, summary)
    written = json.loads(run.summary_path.read_text())
    assert written["report"] == {"path": str(run.out_dir / "report.html")}
    page = (run.out_dir / "report.html").read_text()
    assert page.count('<img src="data:image/png;base64,') == 2 and "[0.7575, 0.825]" in page
    assert not list(run.out_dir.glob("*.tmp"))
    client = run.client
    assert {a.path for a in client.list_artifacts(run.run_id)} == {"report.html", "summary.json"}
    assert client.get_run(run.run_id).info.status == "FINISHED"


def test_a_report_that_cannot_be_built_is_a_warning_and_a_line_in_the_summary(run, caplog):
    (run.out_dir / "gate_report.json").write_text("{not json")
    summary = summary_of(run, status="failed") | {"failed_stage": "policy", "error": "policy: circuit breaker"}
    with caplog.at_level(logging.WARNING, logger="tasks.run_report"):
        assert write_run_report(run, summary)["error"].startswith("JSONDecodeError: ")
    assert "the run report was not written: JSONDecodeError" in caplog.text
    finish_pipeline_run.fn(run, summary)  # the run closes as it ended, its own error kept
    written = json.loads(run.summary_path.read_text())
    assert written["error"] == "policy: circuit breaker" and "JSONDecodeError" in written["report"]["error"]
    parent = run.client.get_run(run.run_id)
    assert parent.info.status == "FAILED" and parent.data.tags["failure_reason"] == "policy: circuit breaker"
    assert not (run.out_dir / "report.html").exists()
