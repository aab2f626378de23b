"""What `rlhf` shows on the terminal when a run fails, and what goes to the log file only."""
from __future__ import annotations

import io
import logging

import pytest

from flows.console import log_file_path, print_failure, print_summary, route_logs, unroute_logs


@pytest.fixture
def terminal():
    """The root logger with one terminal handler only; restored afterwards."""
    root, prefect = logging.getLogger(), logging.getLogger("prefect")
    saved_handlers, saved_level, saved_prefect = root.handlers[:], root.level, (prefect.level, prefect.propagate)
    stream = io.StringIO()
    root.handlers = [logging.StreamHandler(stream)]
    root.setLevel(logging.INFO)
    prefect.setLevel(logging.INFO)  # the suite runs with PREFECT_LOGGING_LEVEL=WARNING
    prefect.propagate = True
    run_loggers = [logging.getLogger(f"prefect.{kind}") for kind in ("flow_runs", "task_runs")]
    api_handlers = [logger.handlers[:] for logger in run_loggers]
    for logger in run_loggers:
        logger.handlers = []  # Prefect's API handler: no flow run here to send to
    yield stream
    unroute_logs()
    for logger, handlers in zip(run_loggers, api_handlers):
        logger.handlers = handlers
    root.handlers, root.level = saved_handlers, saved_level
    prefect.level, prefect.propagate = saved_prefect


def _log_a_failure() -> None:
    logging.getLogger("prefect.task_runs").info("Finished in state Completed()")
    try:
        raise ValueError("the cause")
    except ValueError:
        logging.getLogger("prefect.task_runs").error("Task run failed with exception", exc_info=True)
    logging.getLogger("prefect.flow_runs").info("Finished in state Failed('Flow run encountered an exception')")


def test_errors_and_failed_states_go_to_the_log_file_only(tmp_path, terminal):
    log = tmp_path / "logs" / "rlhf.log"
    route_logs(log, debug=False)
    _log_a_failure()
    shown = terminal.getvalue()
    assert "Finished in state Completed()" in shown
    assert "Traceback" not in shown and "Task run failed" not in shown and "Failed(" not in shown
    written = log.read_text()
    assert "Traceback" in written and "ValueError: the cause" in written and "Finished in state Failed(" in written


def test_debug_shows_the_tracebacks_on_the_terminal_too(tmp_path, terminal):
    log = tmp_path / "rlhf.log"
    route_logs(log, debug=True)
    _log_a_failure()
    assert "Traceback" in terminal.getvalue() and "Traceback" in log.read_text()


def test_the_failure_block_names_stage_cause_report_summary_log_and_exit_code(tmp_path, capsys):
    summary = {"pipeline": "validate-data", "failed_stage": "validate", "summary_path": "/runs/r/summary.json",
               "error": "bad.jsonl: 1 data check(s) failed\nchosen_differs_from_rejected: 3 rows (lines 1, 2, 3)",
               "stages": {"validate": {"status": "failed", "report": "/runs/r/validation_report.md"}}}
    print_failure(summary, 1, tmp_path / "x.log")
    out = capsys.readouterr().out.splitlines()
    block = [line for line in out if line.strip() and not line.startswith("=")]
    assert block == [
        "validate-data: FAILED at stage 'validate'",
        "  cause:    bad.jsonl: 1 data check(s) failed",
        "            chosen_differs_from_rejected: 3 rows (lines 1, 2, 3)",
        "  report:   /runs/r/validation_report.md",
        "  summary:  /runs/r/summary.json",
        f"  log:      {tmp_path / 'x.log'}  (tracebacks; add --debug to see them here)",
        "  exit code 1",
    ]


def test_log_files_are_per_invocation_under_the_output_dir(tmp_path):
    path = log_file_path(tmp_path / "runs", "validate")
    assert path.parent == (tmp_path / "runs" / "logs").resolve()
    assert path.name.startswith("rlhf-validate-") and path.suffix == ".log"
    assert path != log_file_path(tmp_path / "runs", "validate")


def test_unrouting_closes_the_log_file_and_shows_errors_again(tmp_path, terminal):
    handler = route_logs(tmp_path / "rlhf.log", debug=False)
    unroute_logs()
    logging.getLogger("rlhf.test").error("shown again")
    assert "shown again" in terminal.getvalue()
    assert handler not in logging.getLogger().handlers and handler.stream is None


@pytest.mark.parametrize(("report", "line"), [({"path": "/runs/r/report.html"}, "Report:      /runs/r/report.html"),
                                              ({"error": "OSError: disk full"}, "Report:      not written: OSError: disk full"),
                                              (None, None)])
def test_the_summary_names_the_run_report_or_why_there_is_none(capsys, report, line):
    summary = {"pipeline": "rlhf-pipeline", "status": "completed", "stages": {}, "mlflow_run_id": "abc",
               "mlflow_tracking_uri": "http://mlflow:5000", "summary_path": "/runs/r/summary.json"}
    if report is not None:
        summary["report"] = report
    print_summary(summary)
    printed = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Report:")]
    assert printed == ([line] if line else [])


@pytest.mark.parametrize(("chat", "path", "key"), [(False, "/v1/completions", "prompt"),
                                                   (True, "/v1/chat/completions", "messages")])
def test_the_try_it_line_asks_a_chat_model_through_its_template(capsys, chat, path, key):
    import json
    import re
    from pathlib import Path

    from flows.console import print_deployment
    from rlhf_core.config import PipelineConfig

    stage = {"version": "1", "endpoint": "http://127.0.0.1:8100", "served_model_name": "policy-v1", "sample": "x",
             "chat": chat}
    print_deployment(stage, PipelineConfig(), Path("/state"))
    out = capsys.readouterr().out
    assert f"curl -s http://127.0.0.1:8100{path} " in out
    body = json.loads(re.search(r"-d '(\{.*\})'", out).group(1))  # the request body is valid JSON
    assert key in body and body["model"] == "policy-v1"


def test_the_deployment_block_names_the_registered_model_and_the_config_that_stops_it(capsys):
    """A config with a lineage of its own (configs/chat.yaml) is named in `Serving:` and in the
    `Stop it:` command, which with the default config needs no --config."""
    from pathlib import Path

    from flows.console import print_deployment
    from rlhf_core.config import PipelineConfig
    from rlhf_core.config.default import DEFAULT_CONFIG

    stage = {"version": "2", "endpoint": "http://127.0.0.1:8110", "served_model_name": "chat-policy-v2", "sample": "x"}
    cfg = PipelineConfig.model_validate({"tracking": {"registered_model": "chat-policy"}, "sft": {"enabled": True}})
    print_deployment(stage, cfg, Path("/state"), "configs/chat.yaml")
    out = capsys.readouterr().out
    assert "Serving:     chat-policy v2 at http://127.0.0.1:8110/v1" in out
    assert "Stop it:     rlhf serving stop --config configs/chat.yaml\n" in out
    print_deployment(stage, PipelineConfig(), Path("/state"), DEFAULT_CONFIG)
    assert "Stop it:     rlhf serving stop\n" in capsys.readouterr().out


def test_an_undecided_run_closes_with_what_to_do_next(capsys):
    """The candidate is registered with no alias; the block names the command that looks at
    more rows and the one that promotes it past the gates with a reason."""
    steps = {"look at more rows": "rlhf evaluate 4 --set gates.regression_suites.0.max_rows=3200",
             "or promote it anyway": 'rlhf promote 4 --force --reason "..."'}
    summary = {"pipeline": "rlhf-pipeline", "status": "undecided", "mlflow_run_id": "abc",
               "stages": {"register": {"status": "undecided", "version": "4", "aliases": []}},
               "mlflow_tracking_uri": "http://mlflow:5000", "summary_path": "/runs/r/summary.json", "next_steps": steps}
    print_summary(summary)
    out = capsys.readouterr().out.splitlines()
    start = out.index("Undecided:   v4 is registered with no alias and serves nowhere; to decide it:")
    assert out[start + 1].split() == ["look", "at", "more", "rows:", *steps["look at more rows"].split()]
    assert out[start + 2].split() == ["or", "promote", "it", "anyway:", *steps["or promote it anyway"].split()]
