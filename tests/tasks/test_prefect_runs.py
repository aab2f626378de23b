"""A killed pipeline run's Prefect flow run is marked CRASHED by whoever reaps its MLflow run."""
from __future__ import annotations

import logging
import socket
import subprocess
import sys

import pytest
from prefect.states import Cancelling, Completed, Failed, Running, Scheduled

from tasks.prefect_runs import FLOW_RUN_STATE_TAG, FLOW_RUN_TAG, DeadRun, flow_runs_to_crash


def dead_owner() -> tuple[str, str]:
    """`host:pid:start` of a process that has exited, and its pid."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = gone.stdout.strip()
    return f"{socket.gethostname()}:{pid}:12345", pid


# -- which flow runs to mark ------------------------------------------------------------------

def test_only_a_flow_run_still_in_the_state_its_dead_process_left_is_marked():
    running, cancelling = Running(), Cancelling()
    states = {"left-running": running, "old-record": Running(), "completed": Completed(), "failed": Failed(),
              "retry-queued": Scheduled(), "retry-running": Running(), "asking": running, "cancel-asked": cancelling}

    def dead(flow_run_id, state_id=str(running.id), run_id="r1"):
        return DeadRun(run_id, "host-a:42:7", flow_run_id, state_id)

    marked = flow_runs_to_crash([
        dead("left-running"), dead("old-record", state_id=None),  # recorded before the state was: not final is enough
        dead("completed"), dead("failed"), dead("retry-queued"), dead("retry-running"),  # final, or moved since
        dead("unknown"), dead(None), dead("asking"), dead("cancel-asked"),  # not on this server, a stage's run, the caller
    ], states, current_flow_run_id="asking")
    assert list(marked) == ["left-running", "old-record"]
    assert marked["left-running"].startswith(
        "the process (pid 42 on host host-a) that ran this flow is gone; its MLflow run r1 was closed as KILLED by pid ")


# -- against a real Prefect server and MLflow store -------------------------------------------

@pytest.fixture
def store(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_store)
    return client, client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())


def test_a_run_records_its_flow_run_and_the_state_it_ran_in(prefect_server):
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    from tasks.prefect_runs import flow_run_tags

    @task
    def record():
        with get_client(sync_client=True) as prefect:
            return flow_run_tags(), prefect.read_flow_run(flow_run.id).state

    @flow(name="rlhf-pipeline-recording-test")
    def pipeline():
        return record()

    tags, state = pipeline()
    assert state.is_running() and tags == {FLOW_RUN_TAG: str(state.state_details.flow_run_id),
                                           FLOW_RUN_STATE_TAG: str(state.id)}
    assert flow_run_tags() == {}  # outside a flow run


def test_the_reaper_marks_a_killed_runs_flow_run_crashed_and_leaves_finished_ones(prefect_server, store):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Pending

    from tasks.run_start import close_abandoned_runs
    from tasks.tracking import OWNER_TAG

    @flow(name="rlhf-pipeline-reaper-test")
    def pipeline():  # never run: its flow runs are made as a killed `rlhf run` leaves them
        pass

    client, exp = store
    owner, pid = dead_owner()
    with get_client(sync_client=True) as prefect:
        flow_runs = {}
        for name in ("killed", "completed", "retried"):
            flow_runs[name] = prefect.create_flow_run(pipeline, name=name, state=Pending()).id
            prefect.set_flow_run_state(flow_runs[name], Running())
        recorded = {name: prefect.read_flow_run(fr).state.id for name, fr in flow_runs.items()}
        prefect.set_flow_run_state(flow_runs["completed"], Completed())  # the process finished it, then died
        prefect.set_flow_run_state(flow_runs["retried"], Scheduled(), force=True)  # a retry is queued
        runs = {name: client.create_run(exp, run_name=name, tags={
            "pipeline": "rlhf-pipeline", OWNER_TAG: owner, FLOW_RUN_TAG: str(flow_runs[name]),
            FLOW_RUN_STATE_TAG: str(recorded[name])}).info.run_id for name in flow_runs}

        assert sorted(close_abandoned_runs(client, exp)) == sorted(runs.values())
        after = {name: prefect.read_flow_run(fr).state for name, fr in flow_runs.items()}

    assert {name: state.type.value for name, state in after.items()} == {
        "killed": "CRASHED", "completed": "COMPLETED", "retried": "SCHEDULED"}
    assert after["killed"].message.startswith(
        f"the process (pid {pid} on host {socket.gethostname()}) that ran this flow is gone; "
        f"its MLflow run {runs['killed']} was closed as KILLED by pid ")
    assert {client.get_run(run_id).info.status for run_id in runs.values()} == {"KILLED"}


def test_an_unreachable_prefect_server_costs_a_warning_not_the_run(store, free_ports, caplog):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.run_start import close_abandoned_runs
    from tasks.tracking import OWNER_TAG

    client, exp = store
    owner, _ = dead_owner()
    run_id = client.create_run(exp, tags={OWNER_TAG: owner, FLOW_RUN_TAG: "0b5a3d7e-52c4-4e2b-9d1c-1c2f5a8e0f11",
                                          FLOW_RUN_STATE_TAG: "1c6b4e8f-63d5-4f3c-8e2d-2d3a6b9f1a22"}).info.run_id
    [port] = free_ports(1)  # nothing listens there
    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{port}/api"}), caplog.at_level(logging.WARNING):
        assert close_abandoned_runs(client, exp) == [run_id]
    assert client.get_run(run_id).info.status == "KILLED"
    assert "could not mark the Prefect flow runs of 1 dead pipeline run(s) CRASHED" in caplog.text
