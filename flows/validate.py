"""The `validate-data` flow: run the preference-data contract on given files, nothing else."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from rlhf_core.config import load_config
from tasks.data import DataPaths, validate_data
from tasks.tracking import PipelineFailed, finish_pipeline_run, start_pipeline_run, summary_header


@flow(name="validate-data", log_prints=True)
def validate_data_flow(
    preferences_path: str, eval_path: str | None = None, config_path: str = "configs/demo.yaml"
) -> dict[str, Any]:
    """Validate a preference file (JSONL or Parquet) and optionally its eval set, with the
    thresholds of `config_path`; the report goes to MLflow and to a Prefect artifact."""
    cfg = load_config(config_path)
    run = start_pipeline_run(cfg, config_source=str(config_path), flow_name="validate-data")
    paths = DataPaths(Path(preferences_path), Path(eval_path) if eval_path else None, None, generated=False)
    summary = summary_header(run, "validate-data", str(config_path))
    try:
        data = validate_data(paths, cfg, run)
        summary["stages"]["validate"] = {"status": "passed", "rows": data.num_rows,
                                         "dataset_fingerprint": data.fingerprint}
        summary["status"] = "completed"
    except Exception as exc:
        summary["stages"]["validate"] = {"status": "failed", "error": str(exc)}
        summary.update(status="failed", failed_stage="validate", error=str(exc))
        summary["summary_path"] = str(finish_pipeline_run(run, summary))
        raise PipelineFailed(summary) from exc
    summary["summary_path"] = str(finish_pipeline_run(run, summary))
    return summary
