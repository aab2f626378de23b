"""Two pipeline runs started together (a scheduled one and a manual one) on one MLflow store and
one serving state: both finish, or the one that lost the race to promote is refused with a
message that says so; afterwards the registry's champion is what serves."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]

REPO = Path(__file__).resolve().parents[2]


def test_two_runs_started_together_leave_one_champion_that_serves(tmp_path, tiny_config_factory, free_ports):
    from prefect.settings import PREFECT_API_URL

    from rlhf_core.serving import server

    raw = tiny_config_factory(tmp_path)
    raw["gates"] = {"auto_promote": True, "min_accuracy_gain": -1.0, "min_win_rate_vs_reference": 0.0,
                    "min_win_rate_vs_champion": 0.0, "max_regression_vs_champion": 1.0, "max_length_ratio": 100.0,
                    "max_degenerate_rate": 1.0, "max_kl": 1000.0}
    raw["serving"] = {"ports": free_ports(2), "smoke_prompt": "12+34="}
    config = tmp_path / "both.yaml"
    config.write_text(yaml.safe_dump(raw))
    state_dir = tmp_path / "runs" / "serving"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RLHF_FAULT_KILL_AT")}
    env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    try:
        procs = [subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--config", str(config)], cwd=REPO,
                                  env=env, stdout=open(tmp_path / f"run{i}.log", "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True) for i in range(2)]
        codes = [p.wait(1200) for p in procs]
        logs = [(tmp_path / f"run{i}.log").read_text() for i in range(2)]
        summaries = [json.loads(p.read_text()) for p in sorted((tmp_path / "runs").glob("test-*/summary.json"))]
        assert len(summaries) == 2, logs  # two runs, two output directories

        completed = [s for s in summaries if s["status"] == "completed"]
        refused = [s for s in summaries if s["status"] != "completed"]
        assert completed and sorted(codes) == sorted([0] * len(completed) + [1] * len(refused)), (codes, logs)
        for s in refused:  # lost the race: told which champion it found and what to do
            assert s["failed_stage"] == "register", s
            assert "as expected (another run or a person moved it meanwhile)" in s["error"], s
            assert "rlhf evaluate" in s["error"]

        client = MlflowClient(raw["tracking"]["tracking_uri"])
        champion = str(client.get_registered_model("policy").aliases["champion"])
        assert champion in {str(s["stages"]["register"]["version"]) for s in completed}
        current = server.current_endpoint(state_dir)
        assert current is not None and current.version == champion and server.health(current.url)
        assert not (state_dir / "starting.json").exists()
        exp = client.get_experiment_by_name("tests").experiment_id
        assert not client.search_runs([exp], "attributes.status = 'RUNNING'")
        print("\nexit codes", codes, "| champion v" + champion, "| outcomes",
              [(s["status"], s.get("stages", {}).get("register", {}).get("version")) for s in summaries])
    finally:
        server.stop(state_dir)
