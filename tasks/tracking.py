"""MLflow bookkeeping for pipeline runs: one parent run, one nested run per stage.

Runs are addressed by id through `MlflowClient` rather than MLflow's thread-local "active
run", because Prefect may run tasks on other threads than the flow. Opening, locking and
resuming a pipeline run: `tasks.run_start`; its summary and outcome: `tasks.summary`.
"""
from __future__ import annotations

import os
import re
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mlflow.tracking import MlflowClient

from rlhf_core.config import PipelineConfig
from rlhf_core.distributed.fault_injection import fault_point
from rlhf_core.process_owner import this_process
from monitoring.stop import StopRequests
from rlhf_core.models.gpu_room import GpuNeed
from rlhf_core.training.stage_types import MetricsCallback, StageSite, StageStopped

DEFAULT_DB = "mlflow.db"


def resolve_tracking_uri(cfg: PipelineConfig) -> str:
    """Config first, then $MLFLOW_TRACKING_URI, else a SQLite file in the working directory."""
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / DEFAULT_DB}"


def tracking_client(cfg: PipelineConfig) -> MlflowClient:
    """A client of the run's tracking store (and its model registry)."""
    return MlflowClient(resolve_tracking_uri(cfg))


class TrackingStoreError(RuntimeError):
    """The tracking server cannot be reached, or its artifact store refuses writes: a setting to
    fix (the URI, the server's flags or credentials), not a blip that a retry would get past."""


PREFLIGHT_TIMEOUT_S = 5  # MLflow's own client retries a dead server for minutes


def check_tracking_server(uri: str) -> None:
    """Raise `TrackingStoreError` naming `uri` unless its `/health` answers 200 within
    PREFLIGHT_TIMEOUT_S. Only http(s) URIs are checked: a `sqlite:` or `file:` store is local."""
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    fix = "start it or fix tracking.tracking_uri (or MLFLOW_TRACKING_URI)"
    try:
        response = requests.get(f"{uri.rstrip('/')}/health", timeout=PREFLIGHT_TIMEOUT_S)
    except requests.Timeout:
        raise TrackingStoreError(f"tracking server {uri} did not answer within {PREFLIGHT_TIMEOUT_S} s: {fix}") from None
    except requests.RequestException as exc:
        raise TrackingStoreError(f"tracking server {uri} is not reachable ({_connection_failure(exc)}): {fix}") from None
    if response.status_code != 200:
        raise TrackingStoreError(f"tracking server {uri} is not healthy (/health answered {response.status_code}): "
                                 "see the server's log")


def _connection_failure(exc: Exception) -> str:
    text = str(exc)
    for needle, reason in (("Connection refused", "connection refused"), ("Name or service not known", "unknown host"),
                           ("Failed to resolve", "unknown host"), ("No route to host", "no route to host")):
        if needle in text:
            return reason
    return type(exc).__name__


@contextmanager
def mlflow_fails_fast(timeout_s: int = 30):
    """MLflow's HTTP calls inside the block are not retried: an artifact store that refuses a
    write answers 500, which MLflow's client otherwise retries with backoff for minutes."""
    names = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(timeout_s)})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def artifact_refused(uri: str, artifact_uri: str, exc: Exception) -> TrackingStoreError:
    """The error for a first artifact write that failed: the server, where it tried to write, why."""
    text = getattr(exc, "message", None) or str(exc)
    status = re.search(r"too many (\d{3}) error responses|status code (\d{3})", text)
    if status:  # a proxying server answers 500 without the store's reason: its log has it
        cause = f"it answered HTTP {status.group(1) or status.group(2)}; the server's log says why"
    else:
        cause = text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__
    if uri.startswith(("http://", "https://")):
        return TrackingStoreError(
            f"the tracking server {uri} could not store an artifact ({cause}; run artifacts at {artifact_uri}): "
            "check the server's --artifacts-destination and its credentials")
    return TrackingStoreError(f"the tracking store {uri} could not store an artifact at {artifact_uri} ({cause})")


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

    def site(self, stage: str, on_metrics: MetricsCallback | None, stage_run_id: str | None = None,
             gpu_need: GpuNeed | None = None) -> StageSite:
        """Where a training stage of this run writes: `models/<stage>`, its Ray Train run
        `<stage>` under the run's `ray/` (a resumed pipeline run continues it). With the stage's
        MLflow run, a stop requested on it from now on stops the stage (`monitoring.stop`); with
        `gpu_need`, each rank on a GPU first checks its free memory (`models.gpu_room`)."""
        stop = None if stage_run_id is None else StopRequests(self.tracking_uri, stage_run_id)
        return StageSite(self.out_dir / "models" / stage, self.out_dir / "ray", stage, on_metrics, stop, gpu_need)


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


def record_stop(client: MlflowClient, stage_id: str, stopped: StageStopped) -> None:
    """A stage stopped on request: why, after which step and the checkpoint to resume from, as
    tags of its MLflow run, and a warning in the flow's log."""
    from prefect import get_run_logger  # noqa: PLC0415 - this module loads without a flow

    for key, value in {"stopped.reason": stopped.reason, "stopped.step": stopped.step,
                       "checkpoint.path": stopped.checkpoint_path or "none"}.items():
        client.set_tag(stage_id, key, str(value))
    get_run_logger().warning("%s", stopped)


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
