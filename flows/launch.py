"""Starting a flow from the command line: Prefect's temporary server started while the flow
module imports, the log routed to a file of its own, and the outcome printed as one summary or
one error block."""
from __future__ import annotations

import importlib
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from flows.console import log_file_path, print_deployment, print_error, print_failure, print_summary, route_logs
from flows.prefect_setup import start_prefect_server_early


def serving_state_dir(cfg) -> Path:
    from rlhf_core.serving.server import state_dir_for

    return state_dir_for(cfg.serving, cfg.output_dir)


def run_flow(fn, log_path: Path, cfg=None, **kwargs) -> int:
    """Run a flow and print its summary; a failed run prints one block saying why."""
    from tasks.summary import PipelineFailed

    state = fn(**kwargs, return_state=True)
    try:
        summary = state.result()
    except PipelineFailed as exc:
        print_failure(exc.summary, 1, log_path)
        return 1
    except Exception as exc:  # noqa: BLE001 - failed before a summary existed
        logging.getLogger(__name__).debug("flow failed before its summary", exc_info=True)
        print_error(str(exc), 1, log_path)
        return 1
    print_summary(summary)
    if cfg is not None and "deploy" in summary.get("stages", {}):
        print_deployment(summary["stages"]["deploy"], cfg, serving_state_dir(cfg), kwargs.get("config_path"))
    return 3 if summary.get("status") in ("rejected", "undecided") else 0


def run_plain_flow(fn, log_path: Path, **kwargs) -> int:
    """Run a flow whose result is a small dict; print it, or the error."""
    state = fn(**kwargs, return_state=True)
    try:
        result = state.result()
    except Exception as exc:  # noqa: BLE001 - the flow's error is the message
        print_error(str(exc), 1, log_path)
        return 1
    print(json.dumps(result, indent=2, default=str))
    return 0


def exit_on_sigterm() -> None:
    """Let a SIGTERM (`kill`, a container's stop, a scheduler's cancel) end this process through
    Python's exit, while it still has the default handler, which ends it on the spot. The exit
    runs the atexit handler that stops Prefect's temporary server; without it the server (a
    uvicorn process) stays up with no parent. A flow that starts installs Prefect's own handler
    for its run and puts this one back after it."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _stopped)


def _stopped(signum: int, frame) -> None:
    print(f"rlhf: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def flow_module(module: str, args, cfg) -> tuple[Any, Path]:
    """Import a flow module with Prefect's temporary server starting meanwhile; then send the
    log to a file of its own (errors reach the terminal only with --debug)."""
    exit_on_sigterm()
    server_up = start_prefect_server_early()
    flows = importlib.import_module(module)
    server_up()
    log_path = log_file_path(cfg.output_dir, args.command)
    route_logs(log_path, args.debug)
    return flows, log_path
