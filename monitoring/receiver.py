"""Alertmanager webhook receiver: turns alerts into a rollback flow run or a log line.

How to run it, what it answers and how to read its records: docs/operations.md ("The alert
receiver"). The shape of the code, and why:

- `decide` is pure: one alert in, a `Decision` (rollback | notify | resolved | ignore, its
  incident id, a reason) out. A missing or unknown `action` label falls back to notify, so a
  mislabelled rule can never roll anything back. The incident of a rollback alert that names
  a training run is `run-<run>-<stage>`: one unstable run moves `champion` back once, however
  many alerts it trips in however many notifications.
- Nothing is recorded or triggered before the bearer token (compared in constant time) and
  the whole payload have been checked: `parse_payload` says what is wrong and where.
- `Store` claims each (incident, action) with a UNIQUE key inside `BEGIN IMMEDIATE`, so an
  occurrence acts at most once across Alertmanager's re-sends, replays, concurrent requests
  and receiver restarts. A failed trigger answers 500 so that Alertmanager retries; a claim
  left `pending` by a receiver process that is gone (it died mid-call; the claim names its
  host, pid and start time), or past `DEFAULT_CLAIM_TTL_S`, is claimed again by the next delivery,
  and the Prefect idempotency key `alertmanager:<incident>` makes that retry return the flow
  run already created rather than start a second one.
- `PrefectRollbackTrigger` starts the deployment without waiting for it: the on-call path must
  not hold an HTTP request open for a whole rollback.
"""
from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import re
import signal
import sqlite3
import stat
import sys
import threading
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from rlhf_core.process_owner import owner_gone, this_process

log = logging.getLogger("rlhf.receiver")

TOKEN_ENV = "RLHF_RECEIVER_TOKEN"
MIN_TOKEN_CHARS = 16
MAX_BODY_BYTES = 1 << 20
INCIDENT_MAX_CHARS = 120
INCIDENT_RE = re.compile(r"^[A-Za-z0-9_.\-:]{1,120}$")  # what the rollback flow accepts
REASON_MAX_CHARS = 1000
DEFAULT_CLAIM_TTL_S = 300.0
DB_NAME = "receiver.db"
DECISIONS_NAME = "receiver-decisions.jsonl"

RollbackTrigger = Callable[[str, str, str], str]  # (incident, reason, requested_by) -> flow run id


# ---------------------------------------------------------------------------------------
# The decision: pure
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Decision:
    action: str  # rollback | notify | resolved | ignore
    incident: str
    reason: str


_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-:]")
_RFC3339 = re.compile(
    r"^(\d{4})-(\d\d)-(\d\d)[Tt ](\d\d):(\d\d):(\d\d)(\.\d+)?([Zz]|[+-]\d\d:\d\d)$"
)


def parse_rfc3339(text: str) -> datetime | None:
    """Alertmanager's timestamps (nanosecond fractions, `Z` or an offset) as aware UTC."""
    m = _RFC3339.match(text)
    if m is None:
        return None
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    zone = m.group(8)
    offset = timedelta(0) if zone in ("Z", "z") else (
        (1 if zone[0] == "+" else -1) * timedelta(hours=int(zone[1:3]), minutes=int(zone[4:6]))
    )
    try:
        return datetime(year, month, day, hour, minute, second, tzinfo=timezone(offset)).astimezone(timezone.utc)
    except ValueError:
        return None


def incident_id(alertname: str, fingerprint: str, starts_at: str) -> str:
    """`<alertname>-<fingerprint>-<startsAt as compact UTC>`, safe for the rollback flow.
    Seconds are enough: one alert cannot resolve and fire again within a second."""
    when = parse_rfc3339(starts_at)
    stamp = when.strftime("%Y%m%dT%H%M%SZ") if when else _UNSAFE.sub("_", starts_at)[:32]
    tail = f"-{_UNSAFE.sub('_', fingerprint)[:40]}-{stamp}"
    head = _UNSAFE.sub("_", alertname)[: INCIDENT_MAX_CHARS - len(tail)]
    return (head or "alert") + tail


def run_incident_id(run: str, stage: str) -> str:
    """`run-<run>-<stage>`: the incident of every rollback alert about one training run, so
    that a run which trips several alerts (KL explosion, then the circuit breaker, in separate
    notifications) moves `champion` back once, not once per alert."""
    return ("run-" + _UNSAFE.sub("_", f"{run}-{stage}" if stage else run))[:INCIDENT_MAX_CHARS]


def _describe(labels: Mapping[str, str]) -> str:
    rest = ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "alertname")
    return f"{labels.get('alertname', 'alert')} ({rest})" if rest else labels.get("alertname", "alert")


def decide(alert: dict, receiver: str) -> Decision:
    """What to do with one alert of a notification sent to `receiver`. No I/O."""
    labels = alert.get("labels") or {}
    annotations = alert.get("annotations") or {}
    incident = incident_id(str(labels.get("alertname", "")), str(alert.get("fingerprint", "")),
                           str(alert.get("startsAt", "")))
    summary = str(annotations.get("summary") or "").strip() or _describe(labels)
    if alert.get("status") == "resolved":
        return Decision("resolved", incident, summary[:REASON_MAX_CHARS])
    action = labels.get("action")
    if action == "rollback" and labels.get("run"):
        return Decision(action, run_incident_id(str(labels["run"]), str(labels.get("stage", ""))),
                        summary[:REASON_MAX_CHARS])
    if action in ("rollback", "notify"):
        return Decision(action, incident, summary[:REASON_MAX_CHARS])
    if action in ("none", "ignore"):
        return Decision("ignore", incident, f"action={action}: recorded only. {summary}"[:REASON_MAX_CHARS])
    why = "no action label" if action is None else f"unknown action label {action!r} (expected rollback or notify)"
    return Decision("notify", incident, f"{why} in receiver {receiver}: notifying only. {summary}"[:REASON_MAX_CHARS])


# ---------------------------------------------------------------------------------------
# The payload
# ---------------------------------------------------------------------------------------

class PayloadError(ValueError):
    """A notification the receiver will not act on; the message says what and where."""


@dataclass(frozen=True)
class Payload:
    receiver: str
    group_key: str
    status: str
    alerts: tuple[dict, ...]
    truncated_alerts: int = 0


def _require_str(obj: dict, key: str, where: str, *, empty_ok: bool = False) -> str:
    if key not in obj:
        raise PayloadError(f"{where}{key}: missing")
    value = obj[key]
    if not isinstance(value, str):
        raise PayloadError(f"{where}{key}: expected a string, got {type(value).__name__}")
    if not empty_ok and not value:
        raise PayloadError(f"{where}{key}: empty")
    return value


def _string_map(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise PayloadError(f"{where}: expected an object, got {type(value).__name__}")
    for k, v in value.items():
        if not isinstance(v, str):
            raise PayloadError(f"{where}.{k}: expected a string, got {type(v).__name__}")
    return value


def _check_alert(alert: Any, i: int) -> dict:
    where = f"alerts[{i}]"
    if not isinstance(alert, dict):
        raise PayloadError(f"{where}: expected an object, got {type(alert).__name__}")
    status = _require_str(alert, "status", f"{where}.")
    if status not in ("firing", "resolved"):
        raise PayloadError(f"{where}.status: expected firing or resolved, got {status!r}")
    if "labels" not in alert:
        raise PayloadError(f"{where}.labels: missing")
    labels = _string_map(alert["labels"], f"{where}.labels")
    _require_str(labels, "alertname", f"{where}.labels.")
    if alert.get("annotations") is not None:
        _string_map(alert["annotations"], f"{where}.annotations")
    _require_str(alert, "fingerprint", f"{where}.")
    if parse_rfc3339(_require_str(alert, "startsAt", f"{where}.")) is None:
        raise PayloadError(f"{where}.startsAt: not an RFC 3339 time: {alert['startsAt'][:40]!r}")
    return alert


def parse_payload(body: bytes) -> Payload:
    """Validate an Alertmanager webhook body (version 4); raise PayloadError if unusable."""
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise PayloadError(f"body: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise PayloadError(f"body: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if not isinstance(data, dict):
        raise PayloadError(f"body: expected a JSON object, got {type(data).__name__}")
    if data.get("version") != "4":
        got = "missing" if "version" not in data else f"got {data['version']!r}"
        raise PayloadError(f'version: expected "4", {got}')
    receiver = _require_str(data, "receiver", "")
    group_key = _require_str(data, "groupKey", "")
    status = data.get("status", "firing")
    if status not in ("firing", "resolved"):
        raise PayloadError(f"status: expected firing or resolved, got {status!r}")
    truncated = data.get("truncatedAlerts", 0)
    if not isinstance(truncated, int) or isinstance(truncated, bool) or truncated < 0:
        raise PayloadError(f"truncatedAlerts: expected a non-negative integer, got {truncated!r}")
    alerts = data.get("alerts")
    if not isinstance(alerts, list):
        got = "missing" if alerts is None else f"expected a list, got {type(alerts).__name__}"
        raise PayloadError(f"alerts: {got}")
    if not alerts:
        raise PayloadError("alerts: empty")
    return Payload(receiver, group_key, status, tuple(_check_alert(a, i) for i, a in enumerate(alerts)), truncated)


# ---------------------------------------------------------------------------------------
# The token
# ---------------------------------------------------------------------------------------

class TokenError(ValueError):
    """No usable bearer token: the receiver does not start."""


def check_token(token: str, source: str) -> str:
    if not token:
        raise TokenError(f"{source}: the token is empty")
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenError(f"{source}: the token has {len(token)} characters, at least {MIN_TOKEN_CHARS} are needed")
    if not all("!" <= c <= "~" for c in token):
        raise TokenError(f"{source}: the token must be printable ASCII without spaces (it goes in an HTTP header)")
    return token


def load_token(token_file: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> str:
    """The bearer token from `token_file` (stripped, as Alertmanager's credentials_file is)
    or else from $RLHF_RECEIVER_TOKEN. Raises TokenError if there is none or it is weak."""
    env = os.environ if env is None else env
    if token_file is not None:
        path = Path(token_file)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenError(f"token file {path}: cannot read it ({exc})") from None
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning(json.dumps({"event": "startup",
                                    "warning": f"token file {path} is readable by others; chmod 600"}))
        return check_token(text.strip(), f"token file {path}")
    if env.get(TOKEN_ENV) is not None:
        return check_token(env[TOKEN_ENV].strip(), f"${TOKEN_ENV}")
    raise TokenError(f"no token: pass --token-file or set ${TOKEN_ENV}")


# ---------------------------------------------------------------------------------------
# State: what was decided, in SQLite
# ---------------------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS incidents (
    incident     TEXT NOT NULL,
    action       TEXT NOT NULL,      -- rollback | notify | resolved | ignore
    status       TEXT NOT NULL,      -- rollback: pending | done | failed; others: recorded
    decided_at   TEXT NOT NULL,      -- first decision, UTC
    updated_at   TEXT NOT NULL,
    claimed_at   REAL NOT NULL,      -- epoch seconds of the last claim (stale-claim check)
    attempts     INTEGER NOT NULL,
    outcome      TEXT,               -- triggered | covered by <incident> | error: ... | notified | ...
    flow_run_id  TEXT,
    alertname    TEXT,
    group_key    TEXT,
    receiver     TEXT,
    reason       TEXT,
    owner        TEXT,               -- the receiver process acting on it: host:pid:start
    PRIMARY KEY (incident, action)
);
CREATE TABLE IF NOT EXISTS notifications_seen (
    group_key    TEXT NOT NULL,
    fingerprint  TEXT NOT NULL,
    starts_at    TEXT NOT NULL,
    status       TEXT NOT NULL,
    first_seen   TEXT NOT NULL,
    last_seen    TEXT NOT NULL,
    deliveries   INTEGER NOT NULL,
    PRIMARY KEY (group_key, fingerprint, starts_at, status)
);
"""


def _utc(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class Claim:
    """The result of asking to act on (incident, action): `acquired` means this request
    must act; otherwise `status` is the row's state (done, pending, recorded)."""
    acquired: bool
    status: str
    attempts: int
    flow_run_id: str | None = None


class Store:
    """The receiver's SQLite state. One connection per operation, so request threads (and
    a second receiver process on the same directory) only share the file and its locks."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.time, owner: str | None = None):
        self.path = Path(path)
        self.clock = clock
        self.owner = owner or this_process()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with closing(self._connect()) as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)
            if "owner" not in {row["name"] for row in db.execute("PRAGMA table_info(incidents)")}:
                db.execute("ALTER TABLE incidents ADD COLUMN owner TEXT")  # state written before owners

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.row_factory = sqlite3.Row
        return db

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE: takes the write lock first, so check-then-write cannot interleave."""
        with closing(self._connect()) as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def claim(self, decision: Decision, alertname: str, group_key: str, receiver: str,
              *, retry_pending_after: float) -> Claim:
        """Claim the right to act on `decision`. First claim, a failed earlier attempt, or a
        pending one whose owner process is gone (the receiver died mid-call and was restarted)
        or that is older than `retry_pending_after` seconds: acquired. Anything else: not."""
        now = self.clock()
        initial = "pending" if decision.action == "rollback" else "recorded"
        with self._transaction() as db:
            inserted = db.execute(
                "INSERT OR IGNORE INTO incidents (incident, action, status, decided_at, updated_at, claimed_at,"
                " attempts, alertname, group_key, receiver, reason, owner) VALUES (?,?,?,?,?,?,1,?,?,?,?,?)",
                (decision.incident, decision.action, initial, _utc(now), _utc(now), now,
                 alertname, group_key, receiver, decision.reason, self.owner),
            ).rowcount
            if inserted:
                return Claim(True, initial, 1)
            row = db.execute("SELECT status, attempts, claimed_at, flow_run_id, owner FROM incidents"
                             " WHERE incident = ? AND action = ?", (decision.incident, decision.action)).fetchone()
            stale = row["status"] == "pending" and (
                now - row["claimed_at"] > retry_pending_after or owner_gone(row["owner"]))
            if row["status"] == "failed" or stale:
                db.execute("UPDATE incidents SET status = 'pending', attempts = attempts + 1, claimed_at = ?,"
                           " updated_at = ?, group_key = ?, receiver = ?, owner = ? WHERE incident = ? AND action = ?",
                           (now, _utc(now), group_key, receiver, self.owner, decision.incident, decision.action))
                return Claim(True, "pending", row["attempts"] + 1)
            return Claim(False, row["status"], row["attempts"], row["flow_run_id"])

    def finish(self, incident: str, action: str, status: str, outcome: str, flow_run_id: str | None = None) -> None:
        with closing(self._connect()) as db:
            db.execute("UPDATE incidents SET status = ?, outcome = ?, flow_run_id = ?, updated_at = ?"
                       " WHERE incident = ? AND action = ?",
                       (status, outcome, flow_run_id, _utc(self.clock()), incident, action))

    def mark_seen(self, group_key: str, alert: dict) -> int:
        """Count one delivery of `alert` in group `group_key`; return how many came before."""
        now = _utc(self.clock())
        key = (group_key, alert["fingerprint"], alert["startsAt"], alert["status"])
        with self._transaction() as db:
            row = db.execute("SELECT deliveries FROM notifications_seen WHERE group_key = ? AND fingerprint = ?"
                             " AND starts_at = ? AND status = ?", key).fetchone()
            db.execute("INSERT INTO notifications_seen VALUES (?,?,?,?,?,?,1)"
                       " ON CONFLICT (group_key, fingerprint, starts_at, status) DO UPDATE SET"
                       " deliveries = deliveries + 1, last_seen = excluded.last_seen", (*key, now, now))
        return 0 if row is None else row["deliveries"]

    def incidents(self) -> list[dict]:
        with closing(self._connect()) as db:
            return [dict(r) for r in db.execute("SELECT * FROM incidents ORDER BY decided_at, incident, action")]


class DecisionLog:
    """One JSON line per decision to logger `rlhf.receiver` and to a JSONL file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()

    def write(self, event: str, level: int = logging.INFO, **fields: Any) -> dict:
        record = {"ts": _utc(time.time()), "event": event, **fields}
        line = json.dumps(record, default=str)
        log.log(level, line)
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        return record


# ---------------------------------------------------------------------------------------
# The receiver: auth, then decide, dedup, act, record
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Response:
    status: int
    body: dict


class Receiver:
    """Everything but HTTP: the token check and what a valid notification leads to."""

    def __init__(self, token: str, state_dir: str | os.PathLike, trigger_rollback: RollbackTrigger,
                 *, retry_pending_after: float = DEFAULT_CLAIM_TTL_S, clock: Callable[[], float] = time.time):
        self._token = check_token(token, "token").encode("ascii")
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(self.state_dir / DB_NAME, clock)
        self.decisions = DecisionLog(self.state_dir / DECISIONS_NAME)
        self.trigger_rollback = trigger_rollback
        self.retry_pending_after = retry_pending_after

    def auth_failure(self, authorization: str | None) -> str | None:
        """None if `authorization` carries our bearer token, else why not (never the token)."""
        if not authorization:
            return "no Authorization header"
        scheme, _, credentials = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            return "Authorization is not a bearer token"
        if not hmac.compare_digest(credentials.strip().encode("utf-8", "replace"), self._token):
            return "wrong bearer token"
        return None

    def reject(self, client: str, status: int, why: str, **fields: Any) -> None:
        self.decisions.write("rejected", logging.WARNING, client=client, http_status=status, why=why, **fields)

    def handle(self, payload: Payload, client: str = "") -> Response:
        """Decide on every alert of an authenticated, valid notification and act once per
        incident. 500 if a rollback could not be started (Alertmanager then retries)."""
        results: list[dict] = []
        rollbacks: list[tuple[Decision, Claim, dict]] = []
        for alert in payload.alerts:
            decision = decide(alert, payload.receiver)
            replay = self.store.mark_seen(payload.group_key, alert) > 0
            context = self._context(payload, alert, decision, client) | {"replay": replay}
            claim = self.store.claim(decision, alert["labels"]["alertname"], payload.group_key, payload.receiver,
                                     retry_pending_after=self.retry_pending_after)
            if not claim.acquired:
                self.decisions.write("deduplicated", **context, state=claim.status, flow_run_id=claim.flow_run_id)
                results.append({"incident": decision.incident, "action": decision.action, "result": "duplicate"})
            elif decision.action == "rollback":
                rollbacks.append((decision, claim, context))
            else:
                outcome = {"notify": "notified", "resolved": "resolved", "ignore": "ignored"}[decision.action]
                self.store.finish(decision.incident, decision.action, "recorded", outcome)
                level = logging.WARNING if decision.action == "notify" else logging.INFO
                self.decisions.write("accepted", level, **context, result=outcome)
                results.append({"incident": decision.incident, "action": decision.action, "result": outcome})
        ok = self._roll_back(payload, rollbacks, results) if rollbacks else True
        status = HTTPStatus.OK if ok else HTTPStatus.INTERNAL_SERVER_ERROR
        return Response(status, {"status": "ok" if ok else "error", "results": results})

    def _context(self, payload: Payload, alert: dict, decision: Decision, client: str) -> dict:
        labels, annotations = alert["labels"], alert.get("annotations") or {}
        return {
            "incident": decision.incident, "action": decision.action, "reason": decision.reason,
            "alertname": labels["alertname"], "alert_status": alert["status"],
            "severity": labels.get("severity"), "run": labels.get("run"), "stage": labels.get("stage"),
            "runbook_url": annotations.get("runbook_url"), "fingerprint": alert["fingerprint"],
            "starts_at": alert["startsAt"], "group_key": payload.group_key, "receiver": payload.receiver,
            "client": client,
        }

    def _roll_back(self, payload: Payload, claimed: list[tuple[Decision, Claim, dict]], results: list[dict]) -> bool:
        """One rollback for the rollback alerts this notification newly claimed (Alertmanager
        groups them per run and stage: one notification is one incident)."""
        primary = claimed[0][0]
        others = [decision.incident for decision, _, _ in claimed[1:]]
        reason = primary.reason
        if others:
            reason += f" (with {len(others)} more rollback alert(s): {', '.join(others)})"
        requested_by = f"alertmanager:{payload.receiver}"
        try:
            flow_run_id = str(self.trigger_rollback(primary.incident, reason[:REASON_MAX_CHARS], requested_by))
        except Exception as exc:  # noqa: BLE001 - any failure must be recorded and retried
            outcome = f"error: {type(exc).__name__}: {exc}"[:REASON_MAX_CHARS]
            for decision, claim, context in claimed:
                self.store.finish(decision.incident, "rollback", "failed", outcome)
                self.decisions.write("failed", logging.ERROR, **context, result="error", error=outcome,
                                     attempt=claim.attempts, requested_by=requested_by)
                results.append({"incident": decision.incident, "action": "rollback", "result": "error",
                                "error": outcome})
            return False
        for decision, claim, context in claimed:
            outcome = "triggered" if decision is primary else f"covered by {primary.incident}"
            self.store.finish(decision.incident, "rollback", "done", outcome, flow_run_id)
            self.decisions.write("accepted", logging.WARNING, **context, result=outcome, flow_run_id=flow_run_id,
                                 attempt=claim.attempts, requested_by=requested_by)
            results.append({"incident": decision.incident, "action": "rollback", "result": outcome,
                            "flow_run_id": flow_run_id})
        return True


# ---------------------------------------------------------------------------------------
# The real trigger: a Prefect deployment run
# ---------------------------------------------------------------------------------------

class RollbackTriggerError(RuntimeError):
    """The rollback deployment could not be started."""


class PrefectRollbackTrigger:
    """Starts the `rollback` flow's deployment and returns the flow run id without waiting.

    The Prefect settings (API URL, profile) are those in effect where the trigger is made:
    the receiver calls it from HTTP handler threads, which do not inherit Prefect's
    context variables and would otherwise fall back to the environment's settings.
    """

    def __init__(self, deployment: str = "rollback/rollback", config_path: str | None = None,
                 parameters: dict | None = None):
        from prefect.context import get_settings_context

        self.deployment = deployment
        self.config_path = config_path
        self.parameters = dict(parameters or {})
        self._settings = get_settings_context()

    @property
    def api_url(self) -> str | None:
        return self._settings.settings.api.url

    def check(self) -> None:
        """Raise RollbackTriggerError unless a Prefect API is configured, answers, and has the
        deployment: a receiver that cannot start a rollback must not accept alerts."""
        from prefect import get_client
        from prefect.context import SettingsContext
        from prefect.exceptions import ObjectNotFound

        if self.api_url is None:
            raise RollbackTriggerError(
                "PREFECT_API_URL is not set: the receiver starts rollbacks on the Prefect server where the "
                f"{self.deployment!r} deployment lives; export PREFECT_API_URL=http://<host>:4200/api")
        with SettingsContext(profile=self._settings.profile, settings=self._settings.settings):
            try:
                with get_client(sync_client=True) as client:
                    client.read_deployment_by_name(self.deployment)
            except ObjectNotFound:
                raise RollbackTriggerError(
                    f"the Prefect API at {self.api_url} has no deployment {self.deployment!r}: deploy the rollback "
                    "flow there (prefect deploy --name rollback), or pass --deployment") from None
            except Exception as exc:  # noqa: BLE001 - any failure to reach it is the same refusal
                raise RollbackTriggerError(
                    f"the Prefect API at {self.api_url} (PREFECT_API_URL) did not answer: {type(exc).__name__}: "
                    f"{exc}") from exc

    def parameters_for(self, incident: str, reason: str, requested_by: str) -> dict:
        return {**self.parameters, "incident": incident, "reason": reason, "requested_by": requested_by,
                **({"config_path": self.config_path} if self.config_path else {})}

    def __call__(self, incident: str, reason: str, requested_by: str) -> str:
        from prefect.context import SettingsContext
        from prefect.deployments import run_deployment
        from prefect.exceptions import ObjectNotFound

        if not INCIDENT_RE.match(incident):
            raise RollbackTriggerError(f"incident id {incident!r} does not match {INCIDENT_RE.pattern}")
        # A fresh context object per call: one SettingsContext cannot be entered by two threads.
        with SettingsContext(profile=self._settings.profile, settings=self._settings.settings):
            try:
                flow_run = run_deployment(
                    name=self.deployment,
                    parameters=self.parameters_for(incident, reason, requested_by),
                    timeout=0,  # start it, do not wait for it
                    idempotency_key=f"alertmanager:{incident}",  # a retried call returns the same run
                    flow_run_name=f"rollback-{incident}",
                    as_subflow=False,
                )
            except ObjectNotFound as exc:
                raise RollbackTriggerError(
                    f"Prefect deployment {self.deployment!r} not found at {self.api_url or 'the ephemeral API'}"
                    " (deploy the rollback flow, or pass --deployment)") from exc
            except RollbackTriggerError:
                raise
            except Exception as exc:  # noqa: BLE001 - name Prefect, not just "Connection refused"
                raise RollbackTriggerError(
                    f"starting the Prefect deployment {self.deployment!r} at {self.api_url or 'the ephemeral API'} "
                    f"failed: {type(exc).__name__}: {exc}") from exc
        if not hasattr(flow_run, "id"):  # an async caller gets a coroutine from run_deployment
            raise RollbackTriggerError("PrefectRollbackTrigger must be called from synchronous code")
        return str(flow_run.id)


# ---------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------

class _Handler(BaseHTTPRequestHandler):
    server: "ReceiverServer"
    server_version = "rlhf-receiver"
    timeout = 30  # seconds a client may stall mid-request before its thread gives up
    protocol_version = "HTTP/1.1"

    @property
    def client(self) -> str:
        host, port = self.client_address[:2]
        return f"{host}:{port}"

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's name
        log.debug("%s %s", self.client, format % args)

    def _send(self, status: int, body: dict, headers: Mapping[str, str] | None = None, close: bool = False) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if close:  # the request body was not read: the connection cannot carry another request
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _refuse(self, status: int, why: str, headers: Mapping[str, str] | None = None, close: bool = True) -> None:
        self.server.receiver.reject(self.client, status, why, method=self.command, path=self.path[:200])
        self._send(status, {"status": "rejected", "error": why}, headers, close)

    def do_GET(self) -> None:  # noqa: N802
        if self.path.split("?")[0] == "/healthz":
            self._send(HTTPStatus.OK, {"status": "ok"})
        else:
            self._send(HTTPStatus.NOT_FOUND, {"status": "rejected", "error": "not found"})

    def do_POST(self) -> None:  # noqa: N802
        receiver = self.server.receiver
        if self.path.split("?")[0] != "/alerts":
            return self._refuse(HTTPStatus.NOT_FOUND, f"no such endpoint: POST {self.path[:200]}")
        why = receiver.auth_failure(self.headers.get("Authorization"))
        if why is not None:
            return self._refuse(HTTPStatus.UNAUTHORIZED, why, {"WWW-Authenticate": 'Bearer realm="rlhf-receiver"'})
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            return self._refuse(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required")
        if int(length) > MAX_BODY_BYTES:
            return self._refuse(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                f"body of {int(length)} bytes is over the {MAX_BODY_BYTES}-byte limit")
        body = self.rfile.read(int(length))
        try:
            payload = parse_payload(body)
        except PayloadError as exc:
            return self._refuse(HTTPStatus.BAD_REQUEST, str(exc), close=False)
        try:
            response = receiver.handle(payload, self.client)
        except Exception as exc:  # noqa: BLE001 - state dir broken etc.: answer 500 so Alertmanager retries
            log.exception(json.dumps({"event": "error", "client": self.client, "error": repr(exc)[:500]}))
            return self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"status": "error", "error": type(exc).__name__})
        self._send(response.status, response.body)


class ReceiverServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], receiver: Receiver):
        self.receiver = receiver
        super().__init__(address, _Handler)


def serve_in_thread(
    receiver: Receiver, host: str = "127.0.0.1", port: int = 0
) -> tuple[ReceiverServer, threading.Thread]:
    """Start serving in a daemon thread; `server.server_address` has the bound port.
    Stop with `server.shutdown(); server.server_close()`."""
    server = ReceiverServer((host, port), receiver)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              name="rlhf-receiver", daemon=True)
    thread.start()
    return server, thread


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m monitoring.receiver", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8900)
    parser.add_argument("--token-file", help=f"file holding the bearer token (else ${TOKEN_ENV})")
    parser.add_argument("--state-dir", required=True, help=f"where {DB_NAME} and {DECISIONS_NAME} live")
    parser.add_argument("--deployment", default="rollback/rollback", help="Prefect deployment of the rollback flow")
    parser.add_argument("--config", dest="config_path", help="config_path parameter for the rollback flow")
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
    server = ReceiverServer((args.host, args.port), Receiver(token, args.state_dir, trigger))
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


if __name__ == "__main__":
    sys.exit(main())
