"""The receiver without HTTP: auth, then decide, dedup, act, record."""
from __future__ import annotations

import hmac
import logging
import os
import time
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any, Callable

from monitoring.receiver.auth import check_token
from monitoring.receiver.claims import DB_NAME, DECISIONS_NAME, DEFAULT_CLAIM_TTL_S, Claim, DecisionLog, Store
from monitoring.receiver.decision import REASON_MAX_CHARS, Decision, decide
from monitoring.receiver.payload import Payload

RollbackTrigger = Callable[[str, str, str], str]  # (incident, reason, requested_by) -> flow run id
StopRequest = Callable[[str, str, str], None]  # (run, reason, requested_by): `monitoring.stop.request_stop`


@dataclass(frozen=True)
class Response:
    status: int
    body: dict


class Receiver:
    """Everything but HTTP: the token check and what a valid notification leads to."""

    def __init__(self, token: str, state_dir: str | os.PathLike, trigger_rollback: RollbackTrigger,
                 *, request_stop: StopRequest | None = None, retry_pending_after: float = DEFAULT_CLAIM_TTL_S,
                 clock: Callable[[], float] = time.time):
        self._token = check_token(token, "token").encode("ascii")
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(self.state_dir / DB_NAME, clock)
        self.decisions = DecisionLog(self.state_dir / DECISIONS_NAME)
        self.trigger_rollback = trigger_rollback
        self.request_stop = request_stop
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
        incident. 500 if a rollback could not be started or a stop not requested (Alertmanager
        then retries)."""
        results: list[dict] = []
        rollbacks: list[tuple[Decision, Claim, dict]] = []
        stopped = True
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
            elif decision.action == "stop":
                stopped &= self._stop(payload, decision, claim, context, results)
            else:
                outcome = {"notify": "notified", "resolved": "resolved", "ignore": "ignored"}[decision.action]
                self.store.finish(decision.incident, decision.action, "recorded", outcome)
                level = logging.WARNING if decision.action == "notify" else logging.INFO
                self.decisions.write("accepted", level, **context, result=outcome)
                results.append({"incident": decision.incident, "action": decision.action, "result": outcome})
        ok = (self._roll_back(payload, rollbacks, results) if rollbacks else True) and stopped
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

    def _stop(self, payload: Payload, decision: Decision, claim: Claim, context: dict, results: list[dict]) -> bool:
        """Ask the run to stop after its current step, with a checkpoint (`monitoring.stop`)."""
        requested_by = f"alertmanager:{payload.receiver}"
        try:
            if self.request_stop is None:
                raise RuntimeError("this receiver was started without a tracking URI to reach runs through")
            self.request_stop(str(decision.run), decision.reason, requested_by)
        except Exception as exc:  # noqa: BLE001 - any failure must be recorded and retried
            outcome = f"error: {type(exc).__name__}: {exc}"[:REASON_MAX_CHARS]
            self.store.finish(decision.incident, "stop", "failed", outcome)
            self.decisions.write("failed", logging.ERROR, **context, result="error", error=outcome,
                                 attempt=claim.attempts, requested_by=requested_by)
            results.append({"incident": decision.incident, "action": "stop", "result": "error", "error": outcome})
            return False
        self.store.finish(decision.incident, "stop", "done", "stop requested")
        self.decisions.write("accepted", logging.WARNING, **context, result="stop requested",
                             attempt=claim.attempts, requested_by=requested_by)
        results.append({"incident": decision.incident, "action": "stop", "result": "stop requested"})
        return True

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
