"""Opening a pipeline run: a new one, or the resume of one that stopped (`--resume`, or a
Prefect retry of a failed flow run); the lock that keeps one process per run; and closing the
runs whose process died, in MLflow and in Prefect.
"""
from __future__ import annotations

import fcntl
import os
from datetime import datetime, timezone
from pathlib import Path

import mlflow
import yaml
from mlflow.tracking import MlflowClient
from prefect import get_run_logger, task

from rlhf_core.config import PipelineConfig, load_config
from rlhf_core.distributed.fault_injection import FAULT_ENV, armed
from rlhf_core.process_owner import owner_gone, this_process
from tasks.prefect_runs import FLOW_RUN_TAG, DeadRun, crash_flow_runs, flow_run_tags
from tasks.tracking import (
    OWNER_TAG, PipelineRun, TrackingStoreError, _experiment_id, artifact_refused, check_tracking_server, flatten,
    git_commit, mlflow_fails_fast, resolve_tracking_uri, tracking_client,
)


def close_abandoned_runs(client: MlflowClient, experiment_id: str) -> list[str]:
    """Close as KILLED every run still RUNNING whose owner process is gone (a pipeline killed
    mid-stage leaves its runs RUNNING forever otherwise), with the reason in `failure_reason`, and
    mark their Prefect flow runs CRASHED (`tasks.prefect_runs`). Runs owned by live processes, by
    other hosts, or by nobody known are left alone."""
    closed = []
    for run in client.search_runs([experiment_id], "attributes.status = 'RUNNING'", max_results=1000):
        owner = run.data.tags.get(OWNER_TAG)
        if owner_gone(owner):
            host, pid, _ = owner.rsplit(":", 2)
            client.set_tag(run.info.run_id, "failure_reason",
                           f"killed: the process that ran it (pid {pid} on {host}) ended without closing it; "
                           f"closed by pid {os.getpid()} at {datetime.now(timezone.utc).isoformat(timespec='seconds')}")
            client.set_terminated(run.info.run_id, "KILLED")
            closed.append(DeadRun.of(run, owner))
    crash_flow_runs(closed)
    return [dead.mlflow_run_id for dead in closed]


class FaultRefused(RuntimeError):
    """$RLHF_FAULT is set where a run must not be interrupted (a Prefect deployment's run)."""


def refuse_in_deployment() -> None:
    """A run of a Prefect deployment (scheduled, or started from the UI) never carries a fault."""
    from prefect.runtime import deployment

    if armed() is not None and deployment.id:
        raise FaultRefused(f"${FAULT_ENV} is set ({os.environ[FAULT_ENV]}): fault injection is for tests, and a "
                           f"deployment's run refuses it; unset it in the work pool's environment")


class ResumeRefused(ValueError):
    """`--resume` named a run that cannot be resumed (unknown, finished, or still running)."""


def _retry_unless_refused(task, task_run, state) -> bool:
    """Retry a failed start (a busy tracking store), not a refused resume or a tracking server
    that is not there or refuses artifacts: those will not change in 2 s."""
    try:
        state.result()
    except (ResumeRefused, TrackingStoreError, FaultRefused):
        return False
    except Exception:  # noqa: BLE001 - any other failure is worth the retry
        return True
    return True


@task(name="start-pipeline-run", retries=2, retry_delay_seconds=2, retry_condition_fn=_retry_unless_refused)
def start_pipeline_run(cfg: PipelineConfig, config_source: str, flow_name: str = "rlhf-pipeline",
                       resume: str | None = None) -> PipelineRun:
    """Open the run's MLflow parent run and output directory.

    `resume` (an MLflow run id) continues that run: same parent run and output directory, so
    its completed stages are reused (`tasks.journal`). Without it, a Prefect flow run that
    already opened a run and failed (a retry from the Prefect UI) continues that one.
    """
    from prefect.runtime import flow_run

    refuse_in_deployment()
    uri = resolve_tracking_uri(cfg)
    check_tracking_server(uri)  # before MLflow's client, which retries a dead server for minutes
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    exp_id = _experiment_id(client, cfg.tracking.experiment)
    if closed := close_abandoned_runs(client, exp_id):
        get_run_logger().warning("closed %d MLflow run(s) left RUNNING by a process that died: %s",
                                 len(closed), ", ".join(closed))
    previous = _run_to_resume(client, exp_id, flow_name, resume, flow_run.id)
    if previous is not None:
        return _reopen(client, previous)
    out_dir = _new_out_dir(Path(cfg.output_dir), f"{cfg.name}-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}")
    hold_run_dir(out_dir, out_dir.name)
    run = client.create_run(
        exp_id,
        run_name=out_dir.name,
        tags={"pipeline": flow_name, "config.name": cfg.name, "config.source": config_source, "git.commit": git_commit(),
              OWNER_TAG: this_process(), **flow_run_tags()},
    )
    resolved = cfg.model_dump(mode="json")
    client.log_batch(run.info.run_id, params=[mlflow.entities.Param(k, v[:6000]) for k, v in flatten(resolved).items()])
    _first_artifact(client, uri, run, out_dir, yaml.safe_dump(resolved, sort_keys=False))
    client.set_tag(run.info.run_id, "output_dir", str(out_dir))
    return PipelineRun(uri, exp_id, run.info.run_id, out_dir)


def _first_artifact(client: MlflowClient, uri: str, run, out_dir: Path, config_yaml: str) -> None:
    """Log `config.yaml`, the run's first artifact: an artifact store that refuses it fails the
    start here, with one message naming the server, before any stage trains."""
    try:
        with mlflow_fails_fast():
            client.log_text(run.info.run_id, config_yaml, "config.yaml")
    except Exception as exc:  # noqa: BLE001 - whatever the store answered, it is the cause to name
        error = artifact_refused(uri, run.info.artifact_uri, exc)
        client.set_tag(run.info.run_id, "failure_reason", str(error)[:5000])
        client.set_terminated(run.info.run_id, "FAILED")
        release_run_dir(out_dir)
        raise error from exc


def _new_out_dir(parent: Path, name: str) -> Path:
    """`parent/name`, or `name-2`, `name-3`, ... when runs started in the same second (a
    scheduled and a manual one) already took it: created exclusively, so never shared."""
    parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = (parent / (name if n == 1 else f"{name}-{n}")).resolve()
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"no free output directory for {name} under {parent}")


_held_run_dirs: dict[Path, object] = {}  # out_dir -> its open lock file, while this process runs the run


def hold_run_dir(out_dir: Path, run: str) -> None:
    """One process at a time per run: an exclusive lock on `<out_dir>/run.lock`, held until
    `release_run_dir` (the run's end) or the process's death (the kernel drops it). Two resumes
    of one run started together: the second is refused here."""
    if out_dir in _held_run_dirs:  # this process holds it already (a retried start)
        return
    f = open(out_dir / "run.lock", "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ResumeRefused(f"cannot resume {run}: another process is running it now "
                            f"({out_dir / 'run.lock'} is locked)") from None
    _held_run_dirs[out_dir] = f


def release_run_dir(out_dir: Path) -> None:
    f = _held_run_dirs.pop(out_dir, None)
    if f is not None:
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def _run_to_resume(client: MlflowClient, exp_id: str, flow_name: str, resume: str | None, flow_run_id: str | None):
    """The parent run to continue: `resume`'s (refused with the reason when it cannot be), else
    the failed run this Prefect flow run opened before (a retry), else None."""
    if resume is None:
        if not flow_run_id:
            return None
        earlier = client.search_runs([exp_id], f"tags.`{FLOW_RUN_TAG}` = '{flow_run_id}'", max_results=1)
        return earlier[0] if earlier and earlier[0].info.status in ("FAILED", "KILLED") else None
    return resumable_run(client, resume, flow_name)


def resumable_run(client: MlflowClient, run_id: str, flow_name: str = "rlhf-pipeline"):
    """The parent run `run_id`, if it can be continued: a `flow_name` run that failed, was
    killed, or is left RUNNING by a process that is gone. Else `ResumeRefused` says why."""
    try:
        run = client.get_run(run_id)
    except mlflow.exceptions.MlflowException:
        raise ResumeRefused(f"cannot resume {run_id}: no such run in {client.tracking_uri}") from None
    tags, status = run.data.tags, run.info.status
    if "mlflow.parentRunId" in tags:
        raise ResumeRefused(f"cannot resume {run_id}: it is the run of a stage ({tags.get('stage', 'unknown')}); "
                            f"resume its pipeline run, {tags['mlflow.parentRunId']}")
    if tags.get("pipeline") != flow_name:
        raise ResumeRefused(f"cannot resume {run_id}: it is not an {flow_name} run "
                            f"(its pipeline tag: {tags.get('pipeline', 'none')})")
    if status == "FINISHED":
        raise ResumeRefused(f"cannot resume {run_id}: it finished ({tags.get('outcome', 'completed')}); "
                            "there is nothing to continue: start a new run")
    if status == "RUNNING" and not owner_gone(tags.get(OWNER_TAG)):
        raise ResumeRefused(f"cannot resume {run_id}: it is still running (process {tags.get(OWNER_TAG, 'unknown')}); "
                            "wait for it to end, or stop that process first")
    return run


def _reopen(client: MlflowClient, previous) -> PipelineRun:
    """Mark a failed or killed parent run RUNNING again, owned by this process, and say so in its tags."""
    run_id, tags = previous.info.run_id, previous.data.tags
    hold_run_dir(Path(tags["output_dir"]), run_id)
    attempt = int(tags.get("resume.count", "0")) + 1
    for key, value in {
        "resume.count": str(attempt), OWNER_TAG: this_process(), **flow_run_tags(),
        "resume.previous": f"{previous.info.status}: {tags.get('failure_reason', '')}"[:5000],
        "resume.at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }.items():
        client.set_tag(run_id, key, value)
    for key in ("failure_reason", "outcome"):
        if key in tags:
            client.delete_tag(run_id, key)
    client.update_run(run_id, status="RUNNING")
    get_run_logger().info("resuming pipeline run %s (attempt %d): completed stages are reused", run_id, attempt + 1)
    return PipelineRun(client.tracking_uri, previous.info.experiment_id, run_id, Path(tags["output_dir"]))


def recorded_config(cfg: PipelineConfig, run_id: str) -> PipelineConfig:
    """The config run `run_id` (in `cfg`'s tracking store) started with: a resumed run keeps it."""
    import tempfile

    check_tracking_server(resolve_tracking_uri(cfg))
    client = tracking_client(cfg)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            return load_config(client.download_artifacts(run_id, "config.yaml", tmp))
    except mlflow.exceptions.MlflowException as exc:
        raise ResumeRefused(f"cannot resume {run_id}: its config is not in {client.tracking_uri} ({exc.message})") from None
