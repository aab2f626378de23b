"""Shared fixtures. Expensive components are started once per session and torn down after."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")

REPO = Path(__file__).resolve().parents[1]


def tiny_config_dict(tmp: Path) -> dict:
    """A pipeline config small enough to run every stage in seconds (accuracy is not the point)."""
    return {
        "name": "test",
        "output_dir": str(tmp / "runs"),
        "data": {"demo": {"seed": 0, "n_sft": 240, "n_pairs": 200, "n_eval": 24}},
        "model": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2},
        "sft": {"epochs": 1, "batch_size": 32, "warmup_steps": 2},
        "tracking": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "tests"},
    }


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(tmp_path)))
    return path


@pytest.fixture(scope="session")
def prefect_server():
    """A real, temporary Prefect API server (SQLite, loopback) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
