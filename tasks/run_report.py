"""The run report: gather what a run left (its summary, `gate_report.json`, the policy stage's
metric histories in MLflow), render it (`rlhf_core.report`), write `report.html` beside
`summary.json` and attach it to the pipeline's parent MLflow run, which shows it inline.

`write_run_report` never raises: a report that cannot be built must not turn a good run into
a failed one, nor hide a failed run's own error. It returns what the summary records.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from mlflow.tracking import MlflowClient

from rlhf_core.report import Curves, curve_keys, render_report

if TYPE_CHECKING:  # tasks.summary calls this module when it closes a run
    from tasks.tracking import PipelineRun

REPORT_NAME = "report.html"
GATE_REPORT = "gate_report.json"


def _logger():
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


def write_run_report(run: PipelineRun, summary: dict) -> dict[str, str]:
    """`{"path": <report.html>}`, or `{"error": <why not>}` with a warning in the run's log."""
    try:
        path = build_run_report(run, summary)
    except Exception as exc:  # noqa: BLE001 - the report is a view of the run, never its outcome
        error = f"{type(exc).__name__}: {exc}"
        _logger().warning("the run report was not written: %s", error)
        return {"error": error}
    return {"path": str(path)}


def build_run_report(run: PipelineRun, summary: dict) -> Path:
    """Render the report of `run`, write it atomically to `<out_dir>/report.html` and log it
    to the parent run. Raises whatever goes wrong."""
    plain = json.loads(json.dumps(summary, default=str))  # exactly what summary.json says
    gate_path = run.out_dir / GATE_REPORT
    gate = json.loads(gate_path.read_text()) if gate_path.exists() else None
    page = render_report(plain, gate, policy_curves(run.client, run.experiment_id, run.run_id))
    path = run.out_dir / REPORT_NAME
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, path)
    run.client.log_artifact(run.run_id, str(path))
    return path


def policy_curves(client: MlflowClient, experiment_id: str, parent_run_id: str) -> Curves:
    """The curves `rlhf_core.report` plots, from the policy stage runs nested in the parent
    run. A resumed run may have several (the attempt that failed and the one that went on from
    its checkpoint): read oldest first, a later attempt's value of a step replaces an earlier
    one's, so the curve is the run's whole history."""
    stage_runs = client.search_runs(
        [experiment_id], f"tags.mlflow.parentRunId = '{parent_run_id}' and tags.stage = 'policy'",
        order_by=["attributes.start_time ASC"])
    wanted = curve_keys()
    by_step: dict[str, dict[int, float]] = {}
    for stage in stage_runs:
        for key in (k for k in wanted if k in stage.data.metrics):
            points = by_step.setdefault(key, {})
            for m in sorted(client.get_metric_history(stage.info.run_id, key), key=lambda m: (m.step, m.timestamp)):
                points[m.step] = m.value
    return {key: sorted(points.items()) for key, points in by_step.items()}
