"""The run summary's link to the Prefect UI follows the configured Prefect server."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN = "0b5c1d2e-3f40-4a5b-8c6d-7e8f90a1b2c3"
SUMMARY = {"pipeline": "rlhf-pipeline", "status": "completed", "stages": {}, "mlflow_run_id": "abc",
           "mlflow_experiment_id": "1", "mlflow_tracking_uri": "sqlite:///m.db", "summary_path": "/s.json",
           "prefect_flow_run_id": RUN}


def printed_summary(tmp_path: Path, **prefect_env: str) -> str:
    """`print_summary` in a fresh process whose only Prefect settings are `prefect_env` (Prefect
    reads them when it is imported); no profile, so nothing else configures a server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PYTHONPATH=str(REPO), **prefect_env)
    code = f"from flows.console import print_summary; print_summary({json.dumps(SUMMARY)})"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout


@pytest.mark.parametrize(
    "prefect_env, link",
    [
        ({"PREFECT_API_URL": "http://10.1.2.3:4555/api"}, "http://10.1.2.3:4555"),
        ({"PREFECT_API_URL": "http://10.1.2.3:4555/api", "PREFECT_UI_URL": "https://prefect.example/ui/"},
         "https://prefect.example/ui"),
    ],
)
def test_the_link_is_the_configured_servers_ui(tmp_path, prefect_env, link):
    out = printed_summary(tmp_path, **prefect_env)
    assert f"Prefect run: {link}/runs/flow-run/{RUN}\n" in out
    assert "4200" not in out and "prefect server start" not in out
    assert "mlflow ui --backend-store-uri sqlite:///m.db" in out  # the local MLflow store: still how to open it


def test_without_a_server_the_summary_says_how_to_start_one(tmp_path):
    out = printed_summary(tmp_path)
    assert "Prefect run:" not in out
    assert f"  prefect server start\n    → http://127.0.0.1:4200/runs/flow-run/{RUN}\n" in out
