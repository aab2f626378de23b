"""The SFT stage is cached on its inputs: the same inputs reuse the trained base policy
(and its MLflow run), a changed setting trains again."""
from __future__ import annotations

import pytest
from prefect import flow

from rlhf_core.config import load_config
from tasks.data import prepare_data, validate_data
from tasks.sft import train_base_policy
from tasks.tracking import start_pipeline_run

pytestmark = pytest.mark.usefixtures("prefect_server")


@flow
def sft_three_times(config_path: str):
    cfg = load_config(config_path)
    run = start_pipeline_run(cfg, config_source=config_path)
    data = validate_data(prepare_data(cfg, run.out_dir), cfg, run)
    first = train_base_policy(data, cfg, run)
    again = train_base_policy(data, cfg, run)
    changed = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"learning_rate": cfg.sft.learning_rate / 2})})
    retrained = train_base_policy(data, changed, run)
    return first, again, retrained


def test_the_same_inputs_reuse_the_base_policy_and_a_changed_setting_retrains(tiny_config):
    first, again, retrained = sft_three_times(str(tiny_config))
    assert again.run_id == first.run_id and again.path == first.path  # from the cache: not trained again
    assert retrained.run_id != first.run_id
    assert first.pipeline_run_id == retrained.pipeline_run_id
