"""State: what was decided, in SQLite (`Store`: claims and deliveries seen) and as JSON lines
(`DecisionLog`)."""
from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

from monitoring.receiver.decision import Decision
from rlhf_core.process_owner import owner_gone, this_process

log = logging.getLogger("rlhf.receiver")

DEFAULT_CLAIM_TTL_S = 300.0
DB_NAME = "receiver.db"
DECISIONS_NAME = "receiver-decisions.jsonl"


_SCHEMA = """
CREATE TABLE IF NOT EXISTS incidents (
    incident     TEXT NOT NULL,
    action       TEXT NOT NULL,      -- rollback | notify | resolved | ignore
    status       TEXT NOT NULL,      -- rollback, stop: pending | done | failed; others: recorded
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
        initial = "pending" if decision.action in ("rollback", "stop") else "recorded"
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
