"""The `rlhf-pipeline` flow: validate → SFT base policy (later stages join as they are built).

The flow only composes tasks. Every run writes `summary.json` (stage verdicts and headline
figures) into its output directory, whether it completes or fails, so that schedulers and
scripts can read the outcome without parsing logs.
"""
from __future__ import annotations

from typing import Any

from prefect import flow

from rlhf_core.config import load_config
from tasks.data import prepare_data, validate_data
from tasks.sft import train_base_policy
from tasks.tracking import PipelineFailed, finish_pipeline_run, start_pipeline_run, summary_header

DEFAULT_CONFIG = "configs/demo.yaml"


@flow(name="rlhf-pipeline", log_prints=True)
def rlhf_pipeline(config_path: str = DEFAULT_CONFIG, overrides: list[str] | None = None) -> dict[str, Any]:
    """Run the RLHF pipeline on the config at `config_path`.

    Args:
        config_path: pipeline config (YAML); `configs/demo.yaml` is the embedded demo.
        overrides: `key.path=value` items applied on top of the file, e.g. `sft.epochs=2`.
    """
    cfg = load_config(config_path, overrides)
    run = start_pipeline_run(cfg, config_source=str(config_path))
    summary = summary_header(run, "rlhf-pipeline", str(config_path))
    stages = summary["stages"]
    try:
        paths = prepare_data(cfg, run.out_dir)
        stages["validate"] = {"status": "running"}
        data = validate_data(paths, cfg, run)
        stages["validate"] = {"status": "passed", "rows": data.num_rows, "dataset_fingerprint": data.fingerprint,
                              "report": str(data.report_path)}
        stages["sft"] = {"status": "running"}
        base = train_base_policy(data, cfg, run)
        stages["sft"] = {"status": "completed", "eval_accuracy": base.eval_accuracy, "model_path": str(base.path),
                         "num_parameters": base.num_parameters, "seconds": round(base.sft_seconds, 1)}
        summary["status"] = "completed"
    except Exception as exc:
        failed = next((k for k, v in stages.items() if v.get("status") == "running"), "setup")
        stages[failed] = {"status": "failed", "error": str(exc)}
        summary.update(status="failed", failed_stage=failed, error=str(exc))
        summary["summary_path"] = str(finish_pipeline_run(run, summary))
        raise PipelineFailed(summary) from exc
    summary["summary_path"] = str(finish_pipeline_run(run, summary))
    return summary
