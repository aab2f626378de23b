"""The `validate-data` flow: run the preference-data contract on given files, nothing else."""
from __future__ import annotations

from typing import Any

from prefect import flow

from rlhf_core.config import load_config
from rlhf_core.config.default import DEFAULT_CONFIG
from tasks.data import prepare_files, validate_data
from tasks.run_start import start_pipeline_run
from tasks.summary import record_stage, recorded_outcome, summary_header


@flow(name="validate-data", log_prints=True)
def validate_data_flow(
    preferences_path: str, eval_path: str | None = None, config_path: str = DEFAULT_CONFIG,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Validate a preference file (JSONL or Parquet) and optionally its eval set, with the
    thresholds of `config_path` and `overrides` (`key.path=value` items, e.g.
    `model.pretrained=DIR`, whose tokenizer renders conversational data); the report goes to
    MLflow and to a Prefect artifact."""
    cfg = load_config(config_path, overrides)
    run = start_pipeline_run(cfg, config_source=str(config_path), flow_name="validate-data")
    summary = summary_header(run, "validate-data", str(config_path))
    with recorded_outcome(run, summary) as stages:
        paths = prepare_files(cfg, preferences_path, eval_path, None, None, run.out_dir / "data", cfg.model.pretrained)
        record_stage(stages, "validate", validate_data, paths, cfg, run)
    return summary
