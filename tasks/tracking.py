"""MLflow bookkeeping for pipeline runs: one parent run, one nested run per stage.

Runs are addressed by id through `MlflowClient` rather than MLflow's thread-local "active
run", because Prefect may run tasks on other threads than the flow.
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import mlflow
import yaml
from mlflow.tracking import MlflowClient
from prefect import get_run_logger, task

from rlhf_core.config import PipelineConfig, load_config
from rlhf_core.process_owner import owner_gone, this_process
from tasks.journal import Stages
from tasks.prefect_runs import FLOW_RUN_TAG, DeadRun, crash_flow_runs, flow_run_tags
from tasks.run_report import write_run_report

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


class PipelineFailed(RuntimeError):
    """A pipeline run failed; `summary` is what its summary.json says (error included)."""

    def __init__(self, summary: dict):
        super().__init__(summary.get("error", "pipeline failed"), summary)

    @property
    def summary(self) -> dict:
        return self.args[1]


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


class ResumeRefused(ValueError):
    """`--resume` named a run that cannot be resumed (unknown, finished, or still running)."""


def _retry_unless_refused(task, task_run, state) -> bool:
    """Retry a failed start (a busy tracking store), not a refused resume: that will not change."""
    try:
        state.result()
    except ResumeRefused:
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

    uri = resolve_tracking_uri(cfg)
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
    client.log_text(run.info.run_id, yaml.safe_dump(resolved, sort_keys=False), "config.yaml")
    client.set_tag(run.info.run_id, "output_dir", str(out_dir))
    return PipelineRun(uri, exp_id, run.info.run_id, out_dir)


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

    client = tracking_client(cfg)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            return load_config(client.download_artifacts(run_id, "config.yaml", tmp))
    except mlflow.exceptions.MlflowException as exc:
        raise ResumeRefused(f"cannot resume {run_id}: its config is not in {client.tracking_uri} ({exc.message})") from None


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


def run_stage(stages: dict, name: str, task_fn, *args):
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


FAULT_ENV = "RLHF_FAULT_KILL_AT"


def fault_point(point: str) -> None:
    """Fault injection for the resume tests: SIGKILL this process when $RLHF_FAULT_KILL_AT names
    `point`. The points: `<stage>:end` (a stage's work done, its MLflow run not yet closed) and
    `<stage>:returned` (its task returned, the journal not yet written)."""
    if os.environ.get(FAULT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


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
