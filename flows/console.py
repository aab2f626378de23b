"""What `rlhf` shows on the terminal: a run's summary, one block when it fails, and where the
full log (tracebacks included) is written.

A failed stage is explained once, by the failure block: which stage, the cause, the report and
summary paths, the exit code. Prefect logs the same failure several times over (the task's
exception with its traceback, the task's and the flow's failed states), so records at ERROR and
above go to the log file only, unless `--debug` asks for them on the terminal too.
"""
from __future__ import annotations

import logging
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RULE = "=" * 72
LOG_FORMAT = "%(asctime)s | %(levelname)-7s | %(name)s - %(message)s"


class _NotAFailureReport(logging.Filter):
    """Drops what repeats a failure the failure block explains: errors, and a run's final
    `Finished in state Failed(...)` line (INFO for a flow run, with the whole exception)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return False
        return not (record.name.startswith(("prefect.flow_runs", "prefect.task_runs"))
                    and record.getMessage().startswith(("Finished in state Failed", "Finished in state Crashed")))


def log_file_path(output_dir: Path, command: str) -> Path:
    """`<output_dir>/logs/rlhf-<command>-<UTC time>.log`, one per invocation."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    return Path(output_dir).resolve() / "logs" / f"rlhf-{command}-{stamp}.log"


_routed: list[tuple[logging.Handler, list[tuple[logging.Handler, logging.Filter]]]] = []  # for unroute_logs


def route_logs(log_path: Path, debug: bool) -> logging.Handler:
    """Send every log record (INFO and up, tracebacks included) to `log_path`; keep errors off
    the terminal's handlers unless `debug`. Call after Prefect has set up its logging (it
    replaces the root logger's handlers when it does); `unroute_logs` undoes it. Returns the
    file handler."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_path, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    filtered = []
    if not debug:
        for terminal in root.handlers:
            if isinstance(terminal, logging.StreamHandler) and not isinstance(terminal, logging.FileHandler):
                filtered.append((terminal, _NotAFailureReport()))
                terminal.addFilter(filtered[-1][1])
    root.addHandler(handler)
    _routed.append((handler, filtered))
    return handler


def unroute_logs() -> None:
    """Undo every `route_logs`: the terminal shows errors again, the log files are closed."""
    root = logging.getLogger()
    while _routed:
        handler, filtered = _routed.pop()
        root.removeHandler(handler)
        handler.close()
        for terminal, log_filter in filtered:
            terminal.removeFilter(log_filter)


def print_summary(summary: dict[str, Any]) -> None:
    """The stages' verdicts and figures, and where the run is recorded."""
    print("\n" + RULE)
    print(f"{summary['pipeline']}: {summary['status'].upper()}")
    for name, info in summary.get("stages", {}).items():
        figures = ", ".join(f"{k}={v}" for k, v in info.items() if k not in ("status", "error", "report", "model_path"))
        print(f"  {name:<10} {info.get('status', '?'):<10} {figures}")
    if summary.get("next_steps"):
        version = summary.get("stages", {}).get("register", {}).get("version", "?")
        print(f"Undecided:   v{version} is registered with no alias and serves nowhere; to decide it:")
        for what, command in summary["next_steps"].items():
            print(f"  {what + ':':<22} {command}")
    print(f"MLflow run:  {summary['mlflow_run_id']}  ({summary['mlflow_tracking_uri']})")
    print(f"Summary:     {summary['summary_path']}")
    report = summary.get("report") or {}
    if report.get("path") or report.get("error"):
        print(f"Report:      {report.get('path') or 'not written: ' + report['error']}")
    uri, flow_run, prefect_ui = summary["mlflow_tracking_uri"], summary.get("prefect_flow_run_id"), prefect_ui_url()
    if prefect_ui and flow_run:
        print(f"Prefect run: {prefect_ui}/runs/flow-run/{flow_run}")
    local = []
    if uri.startswith("sqlite:"):
        local += [f"  mlflow ui --backend-store-uri {uri} --port 5000",
                  f"    → http://127.0.0.1:5000/#/experiments/{summary['mlflow_experiment_id']}/runs/{summary['mlflow_run_id']}"]
    if not prefect_ui and flow_run:  # a temporary server ran it: one started on Prefect's database shows it
        local += ["  prefect server start", f"    → http://127.0.0.1:4200/runs/flow-run/{flow_run}"]
    if local:
        print("Open the UIs on these runs:")
        print("\n".join(local))
    print(RULE)


def prefect_ui_url() -> str | None:
    """The configured Prefect server's UI: `PREFECT_UI_URL`, which Prefect derives from
    `PREFECT_API_URL` (its `/api` dropped) unless set itself; None when no server is configured
    and each run starts a temporary one."""
    from prefect.settings import PREFECT_UI_URL

    return (PREFECT_UI_URL.value() or "").rstrip("/") or None


def print_deployment(stage: dict[str, Any], cfg, state_dir: Path, config_path: str | None = None) -> None:
    """Where the deployed champion serves, its API key, a request to try it and how to stop it
    (`config_path`, the run's config: named unless it is the default)."""
    print(f"Serving:     {cfg.tracking.registered_model} v{stage['version']} at {stage['endpoint']}/v1  (model {stage['served_model_name']!r})")
    print(f"Sample:      {stage['sample']}")
    print(f"API key:     ${cfg.serving.api_key_env}, else the file {state_dir}/api_key")
    chat = stage.get("chat", False)  # a chat model is asked through its template, as in the sample
    asked = (f'"messages": [{{"role": "user", "content": "{cfg.serving.smoke_prompt}"}}], "max_tokens": 32'
             if chat else f'"prompt": "{cfg.serving.smoke_prompt}", "max_tokens": 8')
    print(f"Try it:      curl -s {stage['endpoint']}/v1/{'chat/' if chat else ''}completions "
          f"-H \"Authorization: Bearer $(cat {state_dir}/api_key)\" \\")
    print(f"               -H 'Content-Type: application/json' -d '{{\"model\": \"{stage['served_model_name']}\", "
          f"{asked}, \"temperature\": 0}}'")
    from rlhf_core.config.default import DEFAULT_CONFIG

    named = config_path is not None and Path(config_path).resolve() != Path(DEFAULT_CONFIG).resolve()
    print(f"Stop it:     rlhf serving stop{f' --config {config_path}' if named else ''}")


def print_failure(summary: dict[str, Any], exit_code: int, log_path: Path | None) -> None:
    """One block for a failed run: the stage, the cause, the report, summary and log paths."""
    stage = summary.get("failed_stage", "setup")
    info = summary.get("stages", {}).get(stage, {})
    cause = str(summary.get("error") or info.get("error") or "unknown error").strip().splitlines() or ["unknown error"]
    print("\n" + RULE)
    print(f"{summary['pipeline']}: FAILED at stage {stage!r}")
    print(f"  cause:    {cause[0]}")
    for line in cause[1:]:
        print(f"            {line}")
    if info.get("report"):
        print(f"  report:   {info['report']}")
    if summary.get("summary_path"):
        print(f"  summary:  {summary['summary_path']}")
    if log_path is not None:
        print(f"  log:      {log_path}  (tracebacks; add --debug to see them here)")
    if summary.get("pipeline") == "rlhf-pipeline" and summary.get("mlflow_run_id"):
        print(f"  resume:   rlhf run --resume {summary['mlflow_run_id']}  (completed stages are reused)")
    print(f"  exit code {exit_code}")
    print(RULE)


def print_validated(summary: dict[str, Any]) -> None:
    """The verdict of a passing `rlhf validate`: rows, fingerprint, where the report is."""
    stage = summary["stages"]["validate"]
    print("\n" + RULE)
    print(f"{summary['pipeline']}: PASSED  {stage['rows']} rows  ({stage['dataset_fingerprint']})")
    print(f"  report:   {stage['report']}")
    print(f"  summary:  {summary['summary_path']}")
    print(RULE)


def print_error(message: str, exit_code: int, log_path: Path | None) -> None:
    """A failure before any summary existed: the cause, the log, the exit code (on stderr)."""
    print(f"error: {message}", file=sys.stderr)
    if log_path is not None:
        print(f"log: {log_path}  (tracebacks; add --debug to see them here)", file=sys.stderr)
    print(f"exit code {exit_code}", file=sys.stderr)
