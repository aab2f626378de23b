"""Alertmanager webhook receiver: turns alerts into a rollback flow run, a stop request or a log line.

How to run it, what it answers and how to read its records: docs/operations.md ("The alert
receiver"). The shape of the code, and why:

- `decide` (`decision.py`) is pure: one alert in, a `Decision` (rollback | stop | notify |
  resolved | ignore, its incident id, a reason) out. A missing or unknown `action` label falls back to
  notify, so a mislabelled rule can never roll anything back. The incident of a rollback alert
  that names a training run is `run-<run>-<stage>`: one unstable run moves `champion` back
  once, however many alerts it trips in however many notifications.
- Nothing is recorded or triggered before the bearer token (`auth.py`, compared in constant
  time in `core.py`) and the whole payload have been checked: `parse_payload` (`payload.py`)
  says what is wrong and where.
- `Store` (`claims.py`) claims each (incident, action) with a UNIQUE key inside `BEGIN IMMEDIATE`,
  so an occurrence acts at most once across Alertmanager's re-sends, replays, concurrent requests
  and receiver restarts. A failed trigger answers 500 so that Alertmanager retries; a claim
  left `pending` by a receiver process that is gone (it died mid-call; the claim names its
  host, pid and start time), or past `DEFAULT_CLAIM_TTL_S`, is claimed again by the next delivery,
  and the Prefect idempotency key `alertmanager:<incident>` makes that retry return the flow
  run already created rather than start a second one.
- `PrefectRollbackTrigger` (`actions.py`) starts the deployment without waiting for it: the
  on-call path must not hold an HTTP request open for a whole rollback.
- A `stop` alert that names a run (a fault of the hardware under it) asks that run to stop
  after its current step with a checkpoint, through its MLflow run (`monitoring.stop`); the
  run can then be resumed elsewhere. Claimed like a rollback: once per run and stage.

`Receiver` (`core.py`) is everything but HTTP; `server.py` puts it behind `POST /alerts`, and
`cli.py` is `python -m monitoring.receiver`. Each module imports only the siblings below it,
never this package.
"""
from monitoring.receiver.actions import PrefectRollbackTrigger, RollbackTriggerError
from monitoring.receiver.auth import MIN_TOKEN_CHARS, TOKEN_ENV, TokenError, check_token, load_token
from monitoring.receiver.claims import DB_NAME, DECISIONS_NAME, DEFAULT_CLAIM_TTL_S, Claim, DecisionLog, Store
from monitoring.receiver.cli import main
from monitoring.receiver.core import Receiver, Response, RollbackTrigger, StopRequest
from monitoring.receiver.decision import (
    INCIDENT_MAX_CHARS,
    INCIDENT_RE,
    REASON_MAX_CHARS,
    Decision,
    decide,
    incident_id,
    parse_rfc3339,
    run_incident_id,
)
from monitoring.receiver.payload import Payload, PayloadError, parse_payload
from monitoring.receiver.server import MAX_BODY_BYTES, ReceiverServer, serve_in_thread

__all__ = [
    "DB_NAME", "DECISIONS_NAME", "DEFAULT_CLAIM_TTL_S", "INCIDENT_MAX_CHARS", "INCIDENT_RE", "MAX_BODY_BYTES",
    "MIN_TOKEN_CHARS", "REASON_MAX_CHARS", "TOKEN_ENV",
    "Claim", "Decision", "DecisionLog", "Payload", "PayloadError", "PrefectRollbackTrigger", "Receiver",
    "ReceiverServer", "Response", "RollbackTrigger", "RollbackTriggerError", "StopRequest", "Store", "TokenError",
    "check_token", "decide", "incident_id", "load_token", "main", "parse_payload", "parse_rfc3339",
    "run_incident_id", "serve_in_thread",
]
