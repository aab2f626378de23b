"""Alertmanager webhook receiver: turns alerts into a rollback flow run, a stop request or a log line.

The command line, `python -m monitoring.receiver` (the first line above is its --help text).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from functools import partial
from pathlib import Path

from monitoring.receiver.actions import PrefectRollbackTrigger, RollbackTriggerError
from monitoring.receiver.auth import TOKEN_ENV, TokenError, load_token
from monitoring.receiver.claims import DB_NAME, DECISIONS_NAME
from monitoring.receiver.core import Receiver
from monitoring.receiver.server import ReceiverServer
from monitoring.stop import request_stop

log = logging.getLogger("rlhf.receiver")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m monitoring.receiver", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8900)
    parser.add_argument("--token-file", help=f"file holding the bearer token (else ${TOKEN_ENV})")
    parser.add_argument("--state-dir", required=True, help=f"where {DB_NAME} and {DECISIONS_NAME} live")
    parser.add_argument("--deployment", default="rollback/rollback", help="Prefect deployment of the rollback flow")
    parser.add_argument("--config", dest="config_path", help="config_path parameter for the rollback flow")
    parser.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                        help="MLflow tracking URI through which alerts labelled action=stop reach their run "
                             "(default $MLFLOW_TRACKING_URI; none: such alerts are answered 500 and retried)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        token = load_token(args.token_file)
    except TokenError as exc:
        print(f"monitoring.receiver: {exc}", file=sys.stderr)
        return 2
    trigger = PrefectRollbackTrigger(args.deployment, args.config_path)
    try:
        trigger.check()
    except RollbackTriggerError as exc:
        print(f"monitoring.receiver: not starting: {exc}", file=sys.stderr)
        return 2
    stop = None if not args.tracking_uri else partial(request_stop, args.tracking_uri)
    server = ReceiverServer((args.host, args.port), Receiver(token, args.state_dir, trigger, request_stop=stop))
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    log.info(json.dumps({"event": "startup", "listen": f"http://{args.host}:{server.server_address[1]}/alerts",
                         "state_dir": str(Path(args.state_dir).resolve()), "deployment": args.deployment,
                         "prefect_api": trigger.api_url}))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
