"""The GPU configs that docs/gpu.md describes: each loads as `rlhf check-config` loads it, puts one
Ray Train worker or one rollout engine's GPU on each GPU of its setup, and asks for GPUs.

That none restates a value it would have anyway is checked for every shipped config, these
included, by tests/rlhf_core/test_config_overlays.py. `model.pretrained` names a hub id: loading
a config does not look for the model (the run's `pretrained` stage does), so nothing is fetched.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_core.config import load_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"

# config file -> the GPUs of its setup
GPU_SETUPS = {
    "gpu-1xh100-0.5b.yaml": 1,
    "gpu-8xh100-7b.yaml": 8,
    "gpu-16xh100-7b.yaml": 16,
}


def test_every_gpu_config_shipped_is_one_of_the_setups():
    assert sorted(p.name for p in CONFIGS.glob("gpu-*.yaml")) == sorted(GPU_SETUPS)


@pytest.mark.parametrize("name, gpus", GPU_SETUPS.items(), ids=list(GPU_SETUPS))
def test_a_gpu_config_validates_with_a_worker_or_an_engine_per_gpu_on_gpus(name, gpus):
    cfg = load_config(CONFIGS / name)  # what `rlhf check-config` runs; raises ConfigError when invalid
    rollout = cfg.policy.rollout
    engine_gpus = rollout.num_engines * rollout.tensor_parallel_size if rollout.placement == "separate" else 0
    assert (cfg.reward.num_workers, cfg.policy.num_workers + engine_gpus) == (gpus, gpus)
    assert cfg.reward.use_gpu is True and cfg.policy.use_gpu is True
    assert cfg.model.pretrained is not None


@pytest.mark.parametrize("name", GPU_SETUPS)
def test_check_config_accepts_a_gpu_config(name, capsys):
    from flows.cli import main

    assert main(["check-config", str(CONFIGS / name)]) == 0
    assert f'"name": "{name.removesuffix(".yaml")}"' in capsys.readouterr().out


def test_docs_gpu_describes_every_gpu_config():
    page = (REPO / "docs" / "gpu.md").read_text()
    assert [name for name in GPU_SETUPS if f"configs/{name}" not in page] == []
