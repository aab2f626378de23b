"""What a pipeline run leaves when it ends: `summary.json` (every stage's verdict and
figures, or which stage failed and why), the run report beside it, the parent MLflow run
closed with its outcome, and the run's lock released.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

from prefect import task

from rlhf_core.distributed.fault_injection import fault_point
from tasks.journal import Stages
from tasks.run_report import write_run_report
from tasks.run_start import release_run_dir
from tasks.tracking import PipelineRun, end_run


class PipelineFailed(RuntimeError):
    """A pipeline run failed; `summary` is what its summary.json says (error included)."""

    def __init__(self, summary: dict):
        super().__init__(summary.get("error", "pipeline failed"), summary)

    @property
    def summary(self) -> dict:
        return self.args[1]


def summary_header(run: PipelineRun, pipeline: str, config_source: str) -> dict:
    """The fields every `summary.json` starts with: what ran, and where to find it."""
    from prefect.runtime import flow_run

    return {
        "pipeline": pipeline,
        "config": config_source,
        "prefect_flow_run_id": flow_run.id,
        "mlflow_run_id": run.run_id,
        "mlflow_experiment_id": run.experiment_id,
        "mlflow_tracking_uri": run.tracking_uri,
        "output_dir": str(run.out_dir),
        "stages": {},
    }


def record_stage(stages: dict, name: str, task_fn, *args):
    """Call a stage task, recording in `stages[name]` its status and, on success, the figures
    of the result's `summary()`; a failure is recorded with its error (and the exception's
    `report_path`, when it has one) and re-raised.

    With a journal (`stages` is a `tasks.journal.Stages`), a task that completed in an earlier
    attempt of this run is not called again: its journalled result is returned and its record
    says `reused`. A task that completes is journalled."""
    journal = stages if isinstance(stages, Stages) else None
    task_name = getattr(task_fn, "name", None) or task_fn.__name__
    if journal is not None and (done := journal.completed(task_name)) is not None:
        stages[name] = {**done.summary(), "reused": True}
        return done
    stages[name] = {"status": "running"}
    try:
        result = task_fn(*args)
    except Exception as exc:
        stages[name] = {"status": "failed", "error": str(exc)}
        if getattr(exc, "report_path", None) is not None:  # where the stage wrote what went wrong
            stages[name]["report"] = str(exc.report_path)
        raise
    fault_point(f"{name}:returned")
    if journal is not None:
        journal.record(task_name, result)
    stages[name] = result.summary()
    return result


def _write_summary(run: PipelineRun, summary: dict) -> None:
    tmp = run.summary_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")  # stage order kept
    os.replace(tmp, run.summary_path)


@task(name="finish-pipeline-run", retries=2, retry_delay_seconds=2)
def finish_pipeline_run(run: PipelineRun, summary: dict) -> Path:
    """Write summary.json atomically, then the run report beside it (`tasks.run_report`; its
    path, or why it is missing, goes into the summary as `report`), attach both to the parent
    run and close the run."""
    _write_summary(run, summary)  # first: the outcome is on disk whatever the report does
    summary["report"] = write_run_report(run, summary)
    _write_summary(run, summary)
    client = run.client
    client.log_artifact(run.run_id, str(run.summary_path))
    client.set_tag(run.run_id, "outcome", summary["status"])
    ok = summary["status"] in ("completed", "rejected", "undecided")  # a gate's verdict is a decision, not a crash
    end_run(run, run.run_id, ok, None if ok else summary.get("error"))
    release_run_dir(run.out_dir)
    return run.summary_path


@contextmanager
def recorded_outcome(run: PipelineRun, summary: dict):
    """Close the pipeline run either way: summary.json says completed, or which stage failed
    and why (then `PipelineFailed` carries that summary to the caller)."""
    summary["summary_path"] = str(run.summary_path)
    summary["stages"] = Stages(run.out_dir / "stages")
    try:
        yield summary["stages"]
    except Exception as exc:
        failed = next((k for k, v in summary["stages"].items() if v.get("status") == "failed"), "setup")
        summary.update(status="failed", failed_stage=failed, error=str(exc))
        finish_pipeline_run(run, summary)
        raise PipelineFailed(summary) from exc
    summary.setdefault("status", "completed")  # the flow may have set "rejected"
    finish_pipeline_run(run, summary)
