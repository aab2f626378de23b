"""Expensive deterministic stages are cached on their inputs: the SFT base policy (reused
with its MLflow run) and the data contract's verdict on a dataset fingerprint; a changed
input computes again. The result store outlives test runs, so each test makes its first
call on inputs never seen before (a fresh MLflow store, a fresh setting, or a refresh)."""
from __future__ import annotations

import secrets

import pytest
from prefect import flow

from rlhf_core.config import load_config
from rlhf_core.data.schema import fingerprint
from tasks.cluster import training_cluster
from tasks.data import prepare_data, validate_data
from tasks.sft import train_base_policy
from tasks.run_start import start_pipeline_run

pytestmark = pytest.mark.usefixtures("prefect_server")


@flow
def sft_three_times(config_path: str):
    cfg = load_config(config_path)
    run = start_pipeline_run(cfg, config_source=config_path)
    data = validate_data(prepare_data(cfg, run.out_dir), cfg, run)
    with training_cluster():  # SFT is a Ray task: one cluster for the three calls, as in the pipeline
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


@flow
def contract_twice(config_path: str, min_rows: int):
    from tasks.data import check_data_contract

    cfg = load_config(config_path)
    run = start_pipeline_run(cfg, config_source=config_path)
    paths = prepare_data(cfg, run.out_dir)
    fp = fingerprint([paths.preferences, paths.eval])
    # refresh: the result store outlives test runs, and this data is the same every time
    first = check_data_contract.with_options(refresh_cache=True)(fp, paths, cfg.validation, return_state=True)
    again = check_data_contract(fp, paths, cfg.validation, return_state=True)
    changed = check_data_contract(fp, paths, cfg.validation.model_copy(update={"min_rows": min_rows}),
                                  return_state=True)
    return first, again, changed


def test_the_data_contract_is_checked_once_per_fingerprint_and_settings(tiny_config):
    # a setting never used before (the result store outlives test runs): it must be computed
    first, again, changed = contract_twice(str(tiny_config), min_rows=secrets.randbelow(10**6) + 201)
    assert first.name == "Completed", first
    assert again.name == "Cached" and again.result().to_dict() == first.result().to_dict()
    assert changed.name == "Completed" and not changed.result().success  # more rows asked for than there are
