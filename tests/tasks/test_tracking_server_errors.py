"""A tracking server that is not there, or whose artifact store refuses writes (no such bucket,
or the server's key refused), stops a run at its start with one message naming the server,
before any stage trains, and within seconds (MLflow's own client would retry for minutes)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from rlhf_core.config import load_config
from tasks.run_start import start_pipeline_run
from tasks.tracking import TrackingStoreError, check_tracking_server

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bucketless_server(start_mlflow_server):
    """A tracking server whose --artifacts-destination is a bucket that does not exist."""
    return start_mlflow_server("s3://no-such-bucket/x")


@pytest.fixture(scope="module")
def refused_key_server(start_mlflow_server, s3_server_checking_keys):
    """A tracking server whose artifact store refuses its access key (expired, revoked)."""
    return start_mlflow_server("s3://rlhf-mlflow/x", s3=s3_server_checking_keys)


REFUSING = {"no-such-bucket": ("bucketless_server", "NoSuchBucket"),
            "refused-key": ("refused_key_server", "InvalidAccessKeyId")}  # fixture, the store's reason in the log


def config_with(tmp_path: Path, tiny_config_factory, uri: str) -> Path:
    raw = tiny_config_factory(tmp_path)
    raw["tracking"]["tracking_uri"] = uri
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_an_unreachable_server_is_named_within_seconds(free_ports):
    uri = f"http://127.0.0.1:{free_ports(1)[0]}"
    started = time.monotonic()
    with pytest.raises(TrackingStoreError) as err:
        check_tracking_server(uri)
    assert time.monotonic() - started < 10
    assert str(err.value) == (f"tracking server {uri} is not reachable (connection refused): "
                              "start it or fix tracking.tracking_uri (or MLFLOW_TRACKING_URI)")


def test_local_stores_are_not_checked(tmp_path):
    check_tracking_server(f"sqlite:///{tmp_path / 'mlflow.db'}")  # nothing to reach: no error


def test_the_start_task_refuses_an_unreachable_server_before_creating_anything(tmp_path, tiny_config_factory,
                                                                              free_ports):
    uri = f"http://127.0.0.1:{free_ports(1)[0]}"
    cfg = load_config(config_with(tmp_path, tiny_config_factory, uri))
    started = time.monotonic()
    with pytest.raises(TrackingStoreError, match=f"tracking server {uri} is not reachable"):
        start_pipeline_run.fn(cfg, config_source="test")
    assert time.monotonic() - started < 10
    assert not (tmp_path / "runs").exists()  # no output directory, no stage


@pytest.mark.slow
@pytest.mark.parametrize("case", REFUSING)
def test_a_server_whose_store_refuses_writes_fails_the_start_on_its_first_artifact(
        case, request, tmp_path, tiny_config_factory):
    fixture, reason = REFUSING[case]
    server = request.getfixturevalue(fixture)
    cfg = load_config(config_with(tmp_path, tiny_config_factory, server.url))
    started = time.monotonic()
    with pytest.raises(TrackingStoreError) as err:
        start_pipeline_run.fn(cfg, config_source="test")
    seconds = time.monotonic() - started
    message = str(err.value)
    assert message.startswith(f"the tracking server {server.url} could not store an artifact (")
    assert "check the server's --artifacts-destination and its credentials" in message
    # a proxying server answers 500 without the store's reason (which is in its log)
    assert "it answered HTTP 500; the server's log says why" in message, message
    assert reason in server.log.read_text()
    assert seconds < 60, seconds  # not MLflow's minutes of retries
    print(f"\n{case}: refused in {seconds:.1f} s: {message}")
    # the run it opened is closed as FAILED with the same reason, and no stage started
    client = MlflowClient(server.url)
    [run] = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["failure_reason"] == message
    [out_dir] = (tmp_path / "runs").iterdir()
    assert sorted(p.name for p in out_dir.iterdir()) == ["run.lock"]


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
@pytest.mark.parametrize("case", ["unreachable", *REFUSING])
def test_rlhf_run_prints_one_message_naming_the_server_and_trains_nothing(
        case, request, tmp_path, tiny_config_factory, free_ports):
    from prefect.settings import PREFECT_API_URL

    if case == "unreachable":
        uri, expected = f"http://127.0.0.1:{free_ports(1)[0]}", "is not reachable (connection refused)"
    else:
        uri, expected = request.getfixturevalue(REFUSING[case][0]).url, "could not store an artifact"
    config = config_with(tmp_path, tiny_config_factory, uri)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--config", str(config)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - started
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and uri in errors[0] and expected in errors[0], out
    assert "Traceback" not in out, out
    assert "sft" not in out.lower().replace("sft.", ""), out  # no stage ran, none is summarised
    assert not list((tmp_path / "runs").glob("*/summary.json")) and not list((tmp_path / "runs").glob("*/sft"))
    print(f"\n{case}: {seconds:.1f} s | {errors[0]}")
