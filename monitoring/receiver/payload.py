"""The payload: an Alertmanager webhook body checked whole before anything acts on it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from monitoring.receiver.decision import parse_rfc3339


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
