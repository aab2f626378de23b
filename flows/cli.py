"""`rlhf`: the command line for people and schedulers.

    rlhf run [--config PATH] [--set key.path=value ...]   run the pipeline
             [--resume RUN_ID]                            or continue a failed or killed run
    rlhf demo                                             run it on the packaged configs/demo.yaml
    rlhf validate PATH [--eval PATH] [--record]           validate preference data only
                  [--set key.path=value ...] [--show N]   and print N rows as the trainer sees them
    rlhf check-config PATH [--explain] [--set ...]        validate a config and print it resolved,
                                                          with --explain where each value came from
    rlhf make-demo-data OUT_DIR [--config PATH]           write the demo task's data
    rlhf evaluate [VERSION|ALIAS]                         re-run the gates on a registered policy
    rlhf promote VERSION [--by NAME] [--reason TEXT]      make a policy version the champion
                 [--force]                                past a gate rejection or a rollback (with --reason)
    rlhf deploy                                           serve the champion (blue/green)
    rlhf rollback --incident ID --reason TEXT [--to V]    move the champion back and serve it
    rlhf serving [status|stop|ensure]                     what serves now; stop it; serve something
    rlhf canary start VERSION|status|decide               serve a version to a share of the users beside the
    rlhf canary promote|roll-back [--reason TEXT]          champion; read and act on the call on their thumbs
    rlhf gateway                                          the feedback gateway in front of what serves
    rlhf collect-feedback                                 export new feedback as a preference dataset
    rlhf env [--json]                                     versions, machine and settings for a bug report

Every command takes `--config PATH` (default: the packaged configs/demo.yaml, found from any
directory) and `--debug`. A failed run prints one block: the stage, the cause, the report,
summary and log paths, the exit code; errors and tracebacks go to the log file
(`<output_dir>/logs/`) and reach the terminal only with `--debug`.

Exit codes: 0 success, 1 the run failed (summary.json says why), 2 bad usage or config,
3 the gates rejected the candidate or could not tell it from a bar (undecided): nothing was
registered or deployed. `rlhf serving status`: 0 the registry's champion serves, healthy;
1 nothing healthy serves; 4 a healthy server that is not the champion (it says how to fix it);
it also says when a deploy is under way, and names the processes a server killed alone left
running (`rlhf serving stop` ends them). `rlhf serving ensure`: goes on if a server answers,
else deploys the champion, else runs the demo when there is no champion; it exits as what it ran.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from flows import quick_exit
from flows.config_view import print_config
from flows.console import print_failure, print_validated, unroute_logs
from flows.launch import flow_module, run_flow, run_plain_flow
from flows.prefect_setup import quiet_telemetry
from flows.serving_commands import canary_command, promote_command, serving_command
from flows.show import print_environment, print_rows
from rlhf_core.config import ConfigError, load_config
from rlhf_core.config.default import DEFAULT_CONFIG, OWN_DATA_CONFIG

__all__ = ["main", "quiet_telemetry"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlhf", description="RLHF pipeline: validate → SFT → reward model → PPO/GRPO → gates → deploy.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the rlhf-pipeline flow on a config")
    run.add_argument("--config", default=OWN_DATA_CONFIG,
                     help=f"pipeline config YAML (default {OWN_DATA_CONFIG}: your data, no task of the demo's)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. --set data.preferences_path=my/prefs.jsonl (repeatable)")
    run.add_argument("--resume", metavar="RUN_ID",
                     help="continue a failed or killed run (its MLflow run id): completed stages are reused, "
                          "an interrupted training stage continues from its checkpoint; --config only says "
                          "where the MLflow store is, the run keeps the config it started with")

    demo = sub.add_parser("demo", help=f"run the pipeline on the embedded demo ({DEFAULT_CONFIG})")
    demo.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    demo.set_defaults(config=DEFAULT_CONFIG)

    val = sub.add_parser("validate", help="validate a preference-data file (JSONL or Parquet) and stop")
    val.add_argument("path", help="preference data with prompt, chosen, rejected")
    val.add_argument("--eval", dest="eval_path", help="held-out eval set (prompt, answer) to check for leakage")
    val.add_argument("--config", default=DEFAULT_CONFIG, help="config whose `validation` thresholds apply")
    val.add_argument("--record", action="store_true",
                     help="run it as the validate-data flow, recorded in MLflow and Prefect (slower: starts "
                          "Prefect's temporary server when none is configured)")
    val.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. --set model.pretrained=DIR (repeatable)")
    val.add_argument("--show", type=int, default=0, metavar="N",
                     help="also print N rows as the trainer sees them: rendered, token counts, what is cut")

    chk = sub.add_parser("check-config", help="validate a pipeline config file and print it resolved")
    chk.add_argument("path")
    chk.add_argument("--explain", "--origins", action="store_true",
                     help="print each key, its value and where it came from: default, a file (or its base), --set")
    chk.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    data = sub.add_parser("make-demo-data", help="write the demo task's SFT, preference and eval files")
    data.add_argument("out_dir")
    data.add_argument("--config", default=DEFAULT_CONFIG)

    ev = sub.add_parser("evaluate", help="re-run the gates on a registered policy version")
    ev.add_argument("candidate", nargs="?", default="challenger", help="version number or alias (default challenger)")
    _config_args(ev)

    pro = sub.add_parser("promote", help="make a policy version the champion (records the previous one)")
    pro.add_argument("version", help="version number of `policy` (or an alias, e.g. challenger)")
    pro.add_argument("--by", default=os.environ.get("USER", "unknown"), help="who promotes (default $USER)")
    pro.add_argument("--reason", help="why; recorded on the version (needed to force past a rollback)")
    pro.add_argument("--force", action="store_true",
                     help="promote a version the gates rejected, or one rolled back from (with --reason)")
    pro.add_argument("--deploy", action="store_true", help="serve it right away (deploy-champion)")
    _config_args(pro)

    dep = sub.add_parser("deploy", help="serve the champion of tracking.registered_model (deploy-champion flow)")
    _config_args(dep)

    rb = sub.add_parser("rollback", help="move champion back to the previous version and serve it")
    rb.add_argument("--incident", required=True, help="incident id; a second request for it does nothing")
    rb.add_argument("--reason", required=True)
    rb.add_argument("--by", default=os.environ.get("USER", "unknown"), help="who asks (default $USER)")
    rb.add_argument("--to", dest="to_version", help="version to return to (default: the previous champion)")
    _config_args(rb)

    srv = sub.add_parser("serving", help="show the serving endpoint, stop it, or ensure something serves")
    srv.add_argument("action", nargs="?", choices=["status", "stop", "ensure"], default="status",
                     help="ensure: go on if a server answers, else deploy the champion, else run the demo")
    _config_args(srv)

    _feedback_parsers(sub)

    env = sub.add_parser("env", help="print versions, machine and settings to paste into a bug report")
    env.add_argument("--json", action="store_true", help="the same as JSON")
    _config_args(env)
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true",
                             help="show errors and tracebacks on the terminal too (they always go to the log file)")
    return p


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"pipeline config YAML (default {DEFAULT_CONFIG})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")


def _flow_command(args, cfg) -> int:
    if args.command in ("run", "demo"):
        flows, log = flow_module("flows.pipeline", args, cfg)
        resume = getattr(args, "resume", None)
        return run_flow(flows.rlhf_pipeline, log, cfg=cfg, config_path=args.config, overrides=args.overrides,
                         **({"resume": resume} if resume else {}))
    if args.command == "validate":
        flows, log = flow_module("flows.validate", args, cfg)
        return run_flow(flows.validate_data_flow, log, preferences_path=args.path, eval_path=args.eval_path,
                         config_path=args.config, overrides=args.overrides)
    common = {"config_path": args.config, "overrides": args.overrides}
    if args.command == "evaluate":
        flows, log = flow_module("flows.evaluate", args, cfg)
        return run_flow(flows.evaluate_flow, log, candidate=args.candidate, **common)
    if args.command == "collect-feedback":
        flows, log = flow_module("flows.feedback", args, cfg)
        return run_plain_flow(flows.collect_feedback_flow, log, **common)
    flows, log = flow_module("flows.serving", args, cfg)
    if args.command == "deploy":
        return run_plain_flow(flows.deploy_champion_flow, log, **common)
    return run_plain_flow(flows.rollback_flow, log, incident=args.incident, reason=args.reason,
                           requested_by=args.by, to_version=args.to_version, **common)


def _validate_here(args, cfg) -> int:
    """`rlhf validate` without --record: the data contract and its report, no Prefect or MLflow,
    so the answer comes in about the time Great Expectations takes."""
    from tasks.data_contract import DataFormatError, DataValidationError, check_files, prepare_files

    out_dir = Path(cfg.output_dir).resolve() / f"validate-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"
    summary = {"pipeline": "validate", "config": args.config, "output_dir": str(out_dir),
               "summary_path": str(out_dir / "summary.json")}
    try:  # a conversational file is rendered with model.pretrained's tokenizer first, as a run would
        paths = prepare_files(cfg, args.path, args.eval_path, None, None, out_dir / "data", cfg.model.pretrained)
        summary.update(status="completed", stages={"validate": check_files(paths, cfg, out_dir).summary()})
    except (DataValidationError, DataFormatError, ValueError) as exc:  # InputError, ChatTemplateError are ValueErrors
        stage = {"status": "failed", "error": str(exc)}
        if getattr(exc, "report_path", None) is not None:
            stage["report"] = str(exc.report_path)
        summary.update(status="failed", failed_stage="validate", error=str(exc), stages={"validate": stage})
    out_dir.mkdir(parents=True, exist_ok=True)
    Path(summary["summary_path"]).write_text(json.dumps(summary, indent=2) + "\n")
    if summary["status"] == "failed":
        print_failure(summary, 1, None)
        return 1
    print_validated(summary)
    return 0


def _check_resume(args, cfg):
    """Before any server starts: can `--resume` continue that run? Returns (its config, "") (the
    config it started with: `--config` only says where the MLflow store is), or (cfg, why not)."""
    from tasks.run_start import ResumeRefused, recorded_config, resumable_run
    from tasks.tracking import tracking_client

    if args.overrides:
        return cfg, "--set cannot change a resumed run: it continues with the config it started with"
    try:
        resumable_run(tracking_client(cfg), args.resume)
        return recorded_config(cfg, args.resume), ""
    except ResumeRefused as exc:
        return cfg, str(exc)


def _check_inputs(args) -> None:
    from tasks.data_contract import could_exist

    for p in filter(None, (args.path, args.eval_path)):
        if not could_exist(p):
            raise ConfigError([f"no such file or directory: {p}"], "rlhf validate")


def _feedback_parsers(sub) -> None:
    """`rlhf canary`, `rlhf gateway` and `rlhf collect-feedback`: what users' ratings decide and feed."""
    can = sub.add_parser("canary", help="serve a version to a share of the users beside the champion; read and act "
                         "on the call its users' thumbs make")
    can.add_argument("action", choices=["start", "status", "decide", "promote", "roll-back"],
                     help="decide: act on the test's call once it is promote or roll-back; promote | roll-back: "
                     "end it so (against the call only with --reason)")
    can.add_argument("version", nargs="?", help="with start: the version to serve as the canary")
    can.add_argument("--by", default=os.environ.get("USER", "unknown"), help="who decides (default $USER)")
    can.add_argument("--reason", help="a person's decision against the test's call, recorded on the version")
    _config_args(can)
    gw = sub.add_parser("gateway", help="run the feedback gateway (OpenAI-compatible, records answers and ratings)")
    _config_args(gw)
    col = sub.add_parser("collect-feedback", help="export the feedback since the last export (collect-feedback flow)")
    _config_args(col)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Without PREFECT_API_URL each run starts a temporary local Prefect server; Prefect's
    # default 20 s start-up limit is too tight on a busy 2-core machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    quiet_telemetry()
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    try:
        if args.command == "check-config":
            return print_config(args.path, args.overrides, args.explain)
        if args.command == "make-demo-data":
            from rlhf_core.data.synthetic import generate_demo_data

            files = generate_demo_data(load_config(args.config).data.demo, Path(args.out_dir))
            print("\n".join(str(f) for f in (files.sft, files.preferences, files.eval)))
            return 0
        if args.command == "env":  # before the config is loaded: a broken config is worth reporting too
            return print_environment(args.config, args.overrides, args.json)
        cfg = load_config(args.config, args.overrides)  # fail fast, before any server starts
        if args.command == "validate":
            _check_inputs(args)
            if args.show > 0:
                print_rows(cfg, args.path, args.show)
            if not args.record:
                return _validate_here(args, cfg)
        if args.command == "run" and not args.resume and cfg.data.preferences_path is None \
                and Path(args.config).resolve() == Path(OWN_DATA_CONFIG).resolve():
            print("error: `rlhf run` trains on your data, and data.preferences_path is not set: --set "
                  "data.preferences_path=FILE, or --config a file of your own (docs/own-model-and-data.md); "
                  "the demo is `rlhf demo`", file=sys.stderr)
            return 2
        if getattr(args, "resume", None):
            cfg, refused = _check_resume(args, cfg)
            if refused:
                print(f"error: {refused}", file=sys.stderr)
                return 2
        if args.command == "promote":
            return promote_command(args, cfg)
        if args.command == "serving":
            return serving_command(args, cfg)
        if args.command == "canary":
            return canary_command(args, cfg)
        if args.command == "gateway":
            from rlhf_core.serving.gateway import run_gateway

            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            run_gateway(cfg)
            return 0
        return _flow_command(args, cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        unroute_logs()


def run() -> None:
    """The `rlhf` command: `main` in a process of its own, which ends without the interpreter's
    teardown once its exit handlers have run (`flows.quick_exit`: seconds after a command
    that loaded the model stack)."""
    quick_exit.arm()
    sys.exit(quick_exit.finish(main()))


if __name__ == "__main__":
    run()
