import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_help_lists_the_subcommands():
    out = subprocess.run([sys.executable, "-m", "flows.cli", "--help"], capture_output=True, text=True, check=True)
    for command in ("run", "demo", "validate", "check-config", "make-demo-data"):
        assert command in out.stdout


def test_bad_config_exits_2_naming_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sft:\n  learning_rate: -1\n")
    assert main(["check-config", str(bad)]) == 2
    assert "sft.learning_rate: must be > 0, got -1" in capsys.readouterr().err
    assert main(["run", "--config", str(bad)]) == 2


def test_validate_of_a_missing_file_is_a_usage_error(capsys):
    assert main(["validate", "/nonexistent/prefs.jsonl"]) == 2
    assert "no such file: /nonexistent/prefs.jsonl" in capsys.readouterr().err


@pytest.mark.slow
def test_a_flow_command_without_a_prefect_server_starts_one_temporary_server(tmp_path):
    """With no PREFECT_API_URL the CLI starts Prefect's temporary server while it imports the
    flow's libraries; the flow must then use that server, not start a second one (Prefect
    logs each start), and the command must work as before."""
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config["output_dir"] = str(tmp_path / "runs")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    assert main(["make-demo-data", str(tmp_path / "data"), "--config", str(tmp_path / "config.yaml")]) == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "validate", str(tmp_path / "data" / "preferences.jsonl"),
         "--config", str(tmp_path / "config.yaml")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert log.count("Starting temporary server") == 1, log[-3000:]
    assert "validate-data: COMPLETED" in out.stdout
