"""The pipeline against a team's MLflow: a tracking server on PostgreSQL whose artifacts live in
an S3 bucket (moto), proxied by the server. The client process has no S3 credentials; the
model's weights go up in parts; what the registry hands back is what the policy stage wrote;
nothing lands in a local `mlruns/` or SQLite file."""
from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tasks.registry import CHAMPION, POLICY, fetch_version

LOOSE_GATES = {"auto_promote": True, "min_accuracy_gain": -1.0, "min_win_rate_vs_reference": 0.0,
               "min_win_rate_vs_champion": 0.0, "max_regression_vs_champion": 1.0, "max_length_ratio": 100.0,
               "max_degenerate_rate": 1.0, "max_kl": 1000.0}


def mlflow_tables(path: Path) -> bool:
    """Whether `path` is a SQLite file holding MLflow's tables (another store, e.g. the
    feedback gateway's, may live beside a run)."""
    if path.suffix not in (".db", ".sqlite") or not path.is_file():
        return False
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return bool(db.execute("SELECT 1 FROM sqlite_master WHERE name = 'experiments'").fetchone())


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_large_artifact_goes_up_in_parts_without_s3_credentials(mlflow_server, s3_server, tmp_path, monkeypatch):
    """The multipart settings as the pipeline's process has them: a file above the minimum is
    stored as a multipart object (its ETag ends in -<parts>) and comes back byte-identical."""
    for key in [k for k in os.environ if k.startswith("AWS_")] + ["MLFLOW_S3_ENDPOINT_URL"]:
        monkeypatch.delenv(key, raising=False)
    for key, value in mlflow_server.client_env.items():
        monkeypatch.setenv(key, value)
    chunk = int(mlflow_server.client_env["MLFLOW_MULTIPART_UPLOAD_CHUNK_SIZE"])
    data = os.urandom(5 * chunk + 123)
    (tmp_path / "weights.bin").write_bytes(data)
    client = MlflowClient(mlflow_server.url)
    exp = client.get_experiment_by_name("multipart") or client.get_experiment(client.create_experiment("multipart"))
    run = client.create_run(exp.experiment_id)
    client.log_artifact(run.info.run_id, str(tmp_path / "weights.bin"), artifact_path="model")
    client.set_terminated(run.info.run_id)

    key = f"{mlflow_server.prefix}/{exp.experiment_id}/{run.info.run_id}/artifacts/model/weights.bin"
    etag = s3_server.client().head_object(Bucket=mlflow_server.bucket, Key=key)["ETag"].strip('"')
    assert etag.endswith("-6"), etag  # 5 full parts and the rest
    back = client.download_artifacts(run.info.run_id, "model/weights.bin", str(tmp_path / "back"))
    assert Path(back).read_bytes() == data


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_a_run_tracked_by_the_server_registers_the_champion_in_the_bucket(mlflow_server, s3_server, tmp_path,
                                                                           tiny_config_factory):
    from prefect.settings import PREFECT_API_URL

    raw = tiny_config_factory(tmp_path)
    raw["gates"].update(LOOSE_GATES)
    raw["serving"] = {"enabled": False}  # the deploy's download is checked below, without vLLM
    raw["tracking"]["tracking_uri"] = mlflow_server.url
    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump(raw))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "MLFLOW_S3_ENDPOINT_URL") and not k.startswith("AWS_")}
    env.update(mlflow_server.client_env, PREFECT_API_URL=PREFECT_API_URL.value())
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--config", str(config)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1100)
    [summary_path] = (tmp_path / "runs").glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert done.returncode == 0 and summary["status"] == "completed", (done.stdout[-3000:], done.stderr[-3000:])
    assert summary["mlflow_tracking_uri"] == mlflow_server.url

    # the parent run and a nested run per stage are on the server
    client = MlflowClient(mlflow_server.url)
    parent = client.get_run(summary["mlflow_run_id"])
    assert parent.info.status == "FINISHED" and parent.info.artifact_uri.startswith("mlflow-artifacts:")
    stages = {r.info.run_name: r for r in client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")}
    assert set(stages) == {"validate", "sft", "reward", "policy", "evaluate"}
    assert all(r.info.status == "FINISHED" for r in stages.values())

    # the champion is the policy stage's model, byte for byte, through the server
    champion = client.get_model_version_by_alias(POLICY, CHAMPION)
    assert champion.version == str(summary["stages"]["register"]["version"])
    assert champion.run_id == stages["policy"].info.run_id
    written = files_of(Path(summary["stages"]["policy"]["model_path"]))
    assert "model.safetensors" in written
    fetched = files_of(fetch_version(mlflow_server.url, champion.version, tmp_path / "serving-models"))  # deploy's path
    assert {name: fetched[name] for name in written} == written
    assert set(fetched) - set(written) == {"README.md"}  # the model card the register stage adds

    # the objects are in the bucket under the artifact prefix, the weights uploaded in parts
    s3 = s3_server.client()
    run_root = f"{mlflow_server.prefix}/{parent.info.experiment_id}/{champion.run_id}/artifacts/model/"
    listed = s3.list_objects_v2(Bucket=mlflow_server.bucket, Prefix=run_root)["Contents"]
    assert {o["Key"].removeprefix(run_root) for o in listed} == set(fetched)
    weights = s3.head_object(Bucket=mlflow_server.bucket, Key=run_root + "model.safetensors")
    chunk = int(mlflow_server.client_env["MLFLOW_MULTIPART_UPLOAD_CHUNK_SIZE"])
    parts = math.ceil(len(written["model.safetensors"]) / chunk)
    assert parts > 1 and weights["ETag"].strip('"').endswith(f"-{parts}"), (weights["ETag"], parts)
    config_key = f"{mlflow_server.prefix}/{parent.info.experiment_id}/{parent.info.run_id}/artifacts/config.yaml"
    assert s3.head_object(Bucket=mlflow_server.bucket, Key=config_key)["ETag"].count("-") == 0  # small: one PUT

    # nothing tracked locally: no mlruns/, mlartifacts/ or MLflow SQLite file where it ran or wrote
    for root in (cwd, tmp_path / "runs"):
        local = [p for p in root.rglob("*") if p.name in ("mlruns", "mlartifacts", "mlflow.db") or mlflow_tables(p)]
        assert local == [], local
    print(f"\npolicy v{champion.version} (champion): {len(written)} files byte-identical through the server; "
          f"model.safetensors {len(written['model.safetensors'])} bytes in {parts} parts (ETag {weights['ETag']})")
