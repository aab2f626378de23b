"""Prefect's side of a pipeline run whose process was killed (SIGKILL, a lost machine): its
flow run would stay RUNNING forever, beside the run that resumed it.

Each pipeline run's MLflow parent run names the Prefect flow run holding it and the state that
flow run was in when it took the run (`flow_run_tags`: set at the run's start and at each
resume or retry). Whoever closes a dead run's MLflow run as KILLED
(`tasks.run_start.close_abandoned_runs`: the next run on that host, or a resume) marks that flow
run CRASHED here, with the reason as its state message, if nothing has moved it since.
"""
from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from uuid import UUID

from prefect import get_run_logger
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import State
from prefect.context import FlowRunContext
from prefect.exceptions import MissingContextError, ObjectNotFound
from prefect.states import Crashed

FLOW_RUN_TAG = "prefect.flow_run_id"  # the Prefect flow run that holds the run: a retry of it resumes the run
FLOW_RUN_STATE_TAG = "prefect.flow_run_state_id"  # that flow run's state when it took the run


def flow_run_tags() -> dict[str, str]:
    """The tags that tie an MLflow run to the Prefect flow run now running it; none outside a flow run."""
    from prefect.runtime import flow_run

    if not flow_run.id:
        return {}
    ctx = FlowRunContext.get()
    state = ctx.flow_run.state if ctx is not None and ctx.flow_run is not None else None
    return {FLOW_RUN_TAG: flow_run.id, **({FLOW_RUN_STATE_TAG: str(state.id)} if state is not None else {})}


@dataclass(frozen=True)
class DeadRun:
    """A pipeline run whose owner process is gone, as its MLflow run recorded it."""

    mlflow_run_id: str
    owner: str  # host:pid:start of the process that held it (rlhf_core.process_owner)
    flow_run_id: str | None  # None: a stage's run, or a run opened outside a flow run
    flow_run_state_id: str | None = None  # None: not recorded (a run tagged before this tag existed)

    @classmethod
    def of(cls, run, owner: str) -> DeadRun:
        """The record of MLflow run `run` (an `mlflow.entities.Run`) held by `owner`."""
        tags = run.data.tags
        return cls(run.info.run_id, owner, tags.get(FLOW_RUN_TAG), tags.get(FLOW_RUN_STATE_TAG))

    @property
    def reason(self) -> str:
        host, pid, _ = self.owner.rsplit(":", 2)
        return (f"the process (pid {pid} on host {host}) that ran this flow is gone; its MLflow run "
                f"{self.mlflow_run_id} was closed as KILLED by pid {os.getpid()} on {socket.gethostname()}")


def flow_runs_to_crash(dead: list[DeadRun], states: Mapping[str, State | None],
                       current_flow_run_id: str | None) -> dict[str, str]:
    """`{flow_run_id: reason}`: the flow runs of `dead` runs to mark CRASHED, given each one's
    current state (`states`; None when the Prefect server has no such flow run).

    Marked: a flow run still in a non-final state, and in the very state its dead process
    recorded (the only state a dead process can leave behind). Left alone: a final one
    (COMPLETED, FAILED, CANCELLED, CRASHED); one moved since (a retry queued or started in a
    new process, a cancel asked for: whoever moved it owns it now); the flow run asking
    (`current_flow_run_id`: a retry keeps its flow run's id)."""
    marked = {}
    for run in dead:
        state = states.get(run.flow_run_id) if run.flow_run_id else None
        if state is None or state.is_final() or run.flow_run_id == current_flow_run_id:
            continue
        if run.flow_run_state_id is not None and str(state.id) != run.flow_run_state_id:
            continue
        marked[run.flow_run_id] = run.reason
    return marked


def _current_state(client: SyncPrefectClient, flow_run_id: str) -> State | None:
    try:
        return client.read_flow_run(UUID(flow_run_id)).state
    except (ValueError, ObjectNotFound):  # not a flow run id, or not this server's flow run
        return None


def _logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


def crash_flow_runs(dead: list[DeadRun]) -> list[str]:
    """Mark CRASHED, with the reason as their message, the flow runs of `dead` runs that
    `flow_runs_to_crash` picks; returns their ids. A Prefect API that cannot be reached (or
    that refuses) costs a warning, never the caller's run: those flow runs stay as they are."""
    if not any(run.flow_run_id for run in dead):
        return []  # nothing to ask Prefect (outside a flow, a client would start a temporary server)
    from prefect.runtime import flow_run

    log = _logger()
    try:
        with get_client(sync_client=True) as client:
            states = {run.flow_run_id: _current_state(client, run.flow_run_id) for run in dead if run.flow_run_id}
            marked = flow_runs_to_crash(dead, states, flow_run.id)
            for flow_run_id, reason in marked.items():
                client.set_flow_run_state(flow_run_id, Crashed(message=reason), force=True)
    except Exception as exc:  # noqa: BLE001 - housekeeping: the run that found them goes on
        log.warning("could not mark the Prefect flow runs of %d dead pipeline run(s) CRASHED (%s: %s); "
                    "they stay as they are", len(dead), type(exc).__name__, exc)
        return []
    if marked:
        log.warning("marked %d Prefect flow run(s) of dead pipeline runs CRASHED: %s", len(marked), ", ".join(marked))
    return list(marked)
