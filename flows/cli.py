"""`rlhf`: the command line for people and schedulers.

    rlhf run [--config PATH] [--set key.path=value ...]   run the pipeline
    rlhf demo                                             run it on configs/demo.yaml
    rlhf validate PATH [--eval PATH] [--config PATH]      validate preference data only
    rlhf check-config PATH                                validate a config file only
    rlhf make-demo-data OUT_DIR [--config PATH]           write the demo task's data

Exit codes: 0 success, 1 the run failed (summary.json says why), 2 bad usage or config.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from rlhf_core.config import ConfigError, load_config

DEFAULT_CONFIG = "configs/demo.yaml"


def quiet_telemetry() -> None:
    """No usage reporting from Prefect, MLflow or Ray: runs are often offline, and a
    failed phone-home only adds errors to the logs. Explicit settings win."""
    for key, value in {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "RAY_USAGE_STATS_ENABLED": "0",
        "DO_NOT_TRACK": "1",
    }.items():
        os.environ.setdefault(key, value)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlhf", description="RLHF pipeline: validate → SFT → reward model → PPO/GRPO → gates → deploy.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the rlhf-pipeline flow on a config")
    run.add_argument("--config", default=DEFAULT_CONFIG, help=f"pipeline config YAML (default {DEFAULT_CONFIG})")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. --set sft.epochs=2 (repeatable)")

    demo = sub.add_parser("demo", help=f"run the pipeline on the embedded demo ({DEFAULT_CONFIG})")
    demo.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    val = sub.add_parser("validate", help="validate a preference-data file (JSONL or Parquet) and stop")
    val.add_argument("path", help="preference data with prompt, chosen, rejected")
    val.add_argument("--eval", dest="eval_path", help="held-out eval set (prompt, answer) to check for leakage")
    val.add_argument("--config", default=DEFAULT_CONFIG, help="config whose `validation` thresholds apply")

    chk = sub.add_parser("check-config", help="validate a pipeline config file and print it resolved")
    chk.add_argument("path")

    data = sub.add_parser("make-demo-data", help="write the demo task's SFT, preference and eval files")
    data.add_argument("out_dir")
    data.add_argument("--config", default=DEFAULT_CONFIG)
    return p


def print_summary(summary: dict[str, Any]) -> None:
    stages = summary.get("stages", {})
    print("\n" + "=" * 72)
    print(f"{summary['pipeline']}: {summary['status'].upper()}")
    for name, info in stages.items():
        figures = ", ".join(f"{k}={v}" for k, v in info.items() if k not in ("status", "error", "report", "model_path"))
        print(f"  {name:<10} {info.get('status', '?'):<10} {figures}")
    if summary.get("error"):
        print(f"  error: {summary['error']}")
    print(f"MLflow run:  {summary['mlflow_run_id']}  ({summary['mlflow_tracking_uri']})")
    print(f"Summary:     {summary['summary_path']}")
    uri = summary["mlflow_tracking_uri"]
    if uri.startswith("sqlite:"):
        print("Open the UIs on these runs:")
        print(f"  .venv/bin/mlflow ui --backend-store-uri {uri} --port 5000")
        print(f"    → http://127.0.0.1:5000/#/experiments/{summary['mlflow_experiment_id']}/runs/{summary['mlflow_run_id']}")
        print("  .venv/bin/prefect server start")
        print(f"    → http://127.0.0.1:4200/runs/flow-run/{summary['prefect_flow_run_id']}")
    print("=" * 72)


def _run_flow(fn, **kwargs) -> int:
    """Run a flow and print its summary; a failed run's summary (and summary.json) say why."""
    from tasks.tracking import PipelineFailed

    state = fn(**kwargs, return_state=True)
    try:
        summary = state.result()
    except PipelineFailed as exc:
        print_summary(exc.summary)
        return 1
    except Exception as exc:  # noqa: BLE001 - failed before a summary existed
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print_summary(summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Without PREFECT_API_URL each run starts a temporary local Prefect server; Prefect's
    # default 20 s start-up limit is too tight on a busy 2-core machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    quiet_telemetry()
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    try:
        if args.command == "check-config":
            cfg = load_config(args.path)
            print(json.dumps(cfg.model_dump(mode="json"), indent=2))
            return 0
        if args.command == "make-demo-data":
            from rlhf_core.data.synthetic import generate_demo_data

            files = generate_demo_data(load_config(args.config).data.demo, Path(args.out_dir))
            print("\n".join(str(f) for f in (files.sft, files.preferences, files.eval)))
            return 0
        if args.command in ("run", "demo"):
            config = getattr(args, "config", DEFAULT_CONFIG)
            load_config(config, args.overrides)  # fail fast, before any server starts
            from flows.pipeline import rlhf_pipeline

            return _run_flow(rlhf_pipeline, config_path=config, overrides=args.overrides)
        if args.command == "validate":
            load_config(args.config)
            for p in filter(None, (args.path, args.eval_path)):
                if not Path(p).is_file():
                    raise ConfigError([f"no such file: {p}"], "rlhf validate")
            from flows.validate import validate_data_flow

            return _run_flow(validate_data_flow, preferences_path=args.path, eval_path=args.eval_path,
                             config_path=args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
