"""The decision, pure: one alert in, a `Decision` (what to do, its incident id, why) out."""
from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Mapping

INCIDENT_MAX_CHARS = 120
INCIDENT_RE = re.compile(r"^[A-Za-z0-9_.\-:]{1,120}$")  # what the rollback flow accepts
REASON_MAX_CHARS = 1000


@dataclass(frozen=True)
class Decision:
    action: str  # rollback | stop | notify | resolved | ignore
    incident: str
    reason: str
    run: str | None = None  # the training run (its stage's MLflow run id) a stop is for


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
    if action == "stop" and labels.get("run"):
        return Decision(action, run_incident_id(str(labels["run"]), str(labels.get("stage", ""))),
                        summary[:REASON_MAX_CHARS], run=str(labels["run"]))
    if action == "stop":
        return Decision("notify", incident, f"action=stop names no run to stop: notifying only. {summary}"
                        [:REASON_MAX_CHARS])
    if action in ("rollback", "notify"):
        return Decision(action, incident, summary[:REASON_MAX_CHARS])
    if action in ("none", "ignore"):
        return Decision("ignore", incident, f"action={action}: recorded only. {summary}"[:REASON_MAX_CHARS])
    why = "no action label" if action is None else f"unknown action label {action!r} (expected rollback, stop or notify)"
    return Decision("notify", incident, f"{why} in receiver {receiver}: notifying only. {summary}"[:REASON_MAX_CHARS])
