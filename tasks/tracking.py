"""MLflow bookkeeping for pipeline runs: one parent run, one nested run per stage.

Runs are addressed by id through `MlflowClient` rather than MLflow's thread-local "active
run", because Prefect may run tasks on other threads than the flow. Opening, locking and
resuming a pipeline run: `tasks.run_start`; its summary and outcome: `tasks.summary`.
"""
from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mlflow.tracking import MlflowClient

from rlhf_core.config import PipelineConfig
from rlhf_core.distributed.fault_injection import fault_point
from rlhf_core.process_owner import this_process

DEFAULT_DB = "mlflow.db"


def resolve_tracking_uri(cfg: PipelineConfig) -> str:
    """Config first, then $MLFLOW_TRACKING_URI, else a SQLite file in the working directory."""
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / DEFAULT_DB}"


def tracking_client(cfg: PipelineConfig) -> MlflowClient:
    """A client of the run's tracking store (and its model registry)."""
    return MlflowClient(resolve_tracking_uri(cfg))


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)
    return out


@dataclass(frozen=True)
class PipelineRun:
    """Where one pipeline run writes: its MLflow parent run and its output directory."""

    tracking_uri: str
    experiment_id: str
    run_id: str
    out_dir: Path

    @property
    def client(self) -> MlflowClient:
        return MlflowClient(self.tracking_uri)

    @property
    def summary_path(self) -> Path:
        return self.out_dir / "summary.json"


def _experiment_id(client: MlflowClient, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    artifact_location = None
    if client.tracking_uri.startswith("sqlite:"):
        # Keep artifacts beside the SQLite store, not wherever the first caller's cwd was.
        db = Path(client.tracking_uri.removeprefix("sqlite:///"))
        artifact_location = (db.parent / "mlartifacts").resolve().as_uri()
    return client.create_experiment(name, artifact_location=artifact_location)


OWNER_TAG = "rlhf.owner"  # host:pid:start of the process that opened the run (rlhf_core.process_owner)


def start_stage_run(run: PipelineRun, stage: str, tags: dict[str, str] | None = None) -> str:
    child = run.client.create_run(
        run.experiment_id, run_name=stage,
        tags={"mlflow.parentRunId": run.run_id, "stage": stage, OWNER_TAG: this_process(), **(tags or {})}
    )
    return child.info.run_id


@contextmanager
def stage_run(run: PipelineRun, stage: str, tags: dict[str, str] | None = None):
    """A nested MLflow run for one stage: FINISHED when the block completes, FAILED with the
    error as `failure_reason` when it raises (the error propagates)."""
    stage_id = start_stage_run(run, stage, tags)
    try:
        yield stage_id
    except Exception as exc:
        end_run(run, stage_id, ok=False, reason=str(exc))
        raise
    fault_point(f"{stage}:end")
    end_run(run, stage_id, ok=True)


def end_run(run: PipelineRun, run_id: str, ok: bool, reason: str | None = None) -> None:
    client = run.client
    if reason:
        client.set_tag(run_id, "failure_reason", reason[:5000])
    client.set_terminated(run_id, "FINISHED" if ok else "FAILED")
