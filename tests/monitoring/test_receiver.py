"""monitoring/receiver/ through its real HTTP server on 127.0.0.1 (port 0), with a
recording trigger; the Prefect trigger against the session's temporary Prefect server."""
from __future__ import annotations

import http.client
import json
import logging
import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from monitoring.receiver import (
    INCIDENT_RE,
    Decision,
    PayloadError,
    PrefectRollbackTrigger,
    Receiver,
    RollbackTriggerError,
    TokenError,
    decide,
    incident_id,
    run_incident_id,
    load_token,
    main,
    parse_payload,
    serve_in_thread,
)

TOKEN = "s3cret-receiver-token-0123456789"
KL_INCIDENT = "PolicyKLExplosion-a1b2c3d4e5f60718-20261122T092844Z"
RUN_INCIDENT = "run-r1-policy"  # a rollback alert naming run r1, stage policy
KL_SUMMARY = "Run r1 (policy): KL to the reference 12.3 is above its bound"


def alert(name="PolicyKLExplosion", action="rollback", status="firing", fingerprint="a1b2c3d4e5f60718",
          starts_at="2026-11-22T09:28:44.123456789Z", summary=KL_SUMMARY, **labels) -> dict:
    return {
        "status": status,
        "labels": {"alertname": name, "severity": "critical", "run": "r1", "stage": "policy",
                   **({"action": action} if action is not None else {}), **labels},
        "annotations": {"summary": summary, "description": "...", "runbook_url": f"docs/runbooks/{name}.md"},
        "startsAt": starts_at,
        "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else "2026-11-22T09:40:00Z",
        "generatorURL": "http://127.0.0.1:9090/graph",
        "fingerprint": fingerprint,
    }


def notification(*alerts: dict, group_key='{}/{action="rollback"}:{run="r1", stage="policy"}') -> dict:
    return {
        "version": "4", "groupKey": group_key, "truncatedAlerts": 0,
        "status": "resolved" if all(a["status"] == "resolved" for a in alerts) else "firing",
        "receiver": "rlhf-receiver", "groupLabels": {"run": "r1", "stage": "policy"},
        "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://127.0.0.1:9093",
        "alerts": list(alerts),
    }


class RecordingTrigger:
    """Stands in for PrefectRollbackTrigger: records calls; fails the first `fail` of them."""

    def __init__(self, fail: int = 0, delay: float = 0.0):
        self.calls: list[tuple[str, str, str]] = []
        self.fail, self.delay = fail, delay
        self._lock = threading.Lock()

    def __call__(self, incident: str, reason: str, requested_by: str) -> str:
        with self._lock:
            self.calls.append((incident, reason, requested_by))
            n = len(self.calls)
        time.sleep(self.delay)
        if n <= self.fail:
            raise ConnectionError("Prefect API unreachable")
        return f"flow-run-{n}"


class Served:
    def __init__(self, receiver: Receiver):
        self.receiver = receiver
        self.server, self.thread = serve_in_thread(receiver, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def post(self, payload, token: str | None = TOKEN, content: bytes | None = None, **headers) -> httpx.Response:
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        body = content if content is not None else json.dumps(payload).encode()
        return httpx.post(f"{self.url}/alerts", content=body, headers={"Content-Type": "application/json", **headers},
                          timeout=30)

    def decisions(self) -> list[dict]:
        path = self.receiver.state_dir / "receiver-decisions.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve(tmp_path):
    """serve(trigger, state_dir=...) -> a running receiver; all are stopped after the test."""
    started: list[Served] = []

    def start(trigger, state_dir=None, **kwargs) -> Served:
        started.append(Served(Receiver(TOKEN, state_dir or tmp_path / "state", trigger, **kwargs)))
        return started[-1]

    yield start
    for s in started:
        s.stop()


# --- decide: pure --------------------------------------------------------------------------

@pytest.mark.parametrize("labels, status, action, reason_has", [
    ({"action": "rollback"}, "firing", "rollback", [KL_SUMMARY]),
    ({"action": "notify"}, "firing", "notify", [KL_SUMMARY]),
    ({}, "firing", "notify", ["no action label", "notifying only", KL_SUMMARY]),
    ({"action": "reboot"}, "firing", "notify", ["unknown action label 'reboot'", "rlhf-receiver", KL_SUMMARY]),
    ({"action": "Rollback"}, "firing", "notify", ["unknown action label 'Rollback'"]),
    ({"action": "none"}, "firing", "ignore", ["recorded only"]),
    ({"action": "rollback"}, "resolved", "resolved", [KL_SUMMARY]),
    ({"action": "notify"}, "resolved", "resolved", [KL_SUMMARY]),
])
def test_decide_maps_status_and_action_label(labels, status, action, reason_has):
    a = alert(action=None, status=status)
    a["labels"].update(labels)
    decision = decide(a, "rlhf-receiver")
    # a rollback alert about a run is that run's incident; anything else is the occurrence's
    expected = run_incident_id(a["labels"]["run"], a["labels"]["stage"]) if action == "rollback" else KL_INCIDENT
    assert decision.action == action and decision.incident == expected
    assert all(part in decision.reason for part in reason_has), decision.reason


def test_decide_reason_without_summary_names_the_alert_and_its_labels():
    a = alert(summary="")
    assert decide(a, "r").reason == "PolicyKLExplosion (action=rollback, run=r1, severity=critical, stage=policy)"


@pytest.mark.parametrize("name, fingerprint, starts_at, expected", [
    ("PolicyKLExplosion", "a1b2c3d4e5f60718", "2026-11-22T09:28:44.123456789Z", KL_INCIDENT),
    ("A", "f", "2026-11-22T11:28:44+02:00", "A-f-20261122T092844Z"),  # offsets become UTC
    ("Bad name/with spaces", "ff", "2026-11-22T09:28:44Z", "Bad_name_with_spaces-ff-20261122T092844Z"),
    ("N" * 300, "0" * 16, "2026-11-22T09:28:44Z", "N" * 86 + "-" + "0" * 16 + "-20261122T092844Z"),
])
def test_incident_id_is_stable_compact_and_accepted_by_the_rollback_flow(name, fingerprint, starts_at, expected):
    got = incident_id(name, fingerprint, starts_at)
    assert got == expected and INCIDENT_RE.match(got) and len(got) <= 120


def test_a_new_occurrence_of_the_same_alert_is_a_new_incident():
    first = decide(alert(action="notify"), "r")
    assert decide(alert(action="notify"), "r") == first
    assert decide(alert(action="notify", starts_at="2026-11-22T10:00:00Z"), "r").incident != first.incident
    # ...but not for a rollback about a run: that run is the incident, however often it alerts
    assert decide(alert(starts_at="2026-11-22T10:00:00Z"), "r").incident == decide(alert(), "r").incident
    assert isinstance(first, Decision)


# --- payload validation -------------------------------------------------------------------

def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


@pytest.mark.parametrize("body, message", [
    (b"{not json", "body: not JSON"),
    (b"\xff\xfe", "body: not UTF-8"),
    (b"[]", "body: expected a JSON object, got list"),
    (json.dumps(notification(alert()) | {"version": "3"}).encode(), "version: expected \"4\", got '3'"),
    (json.dumps(_without(notification(alert()), "version")).encode(), "version: expected \"4\", missing"),
    (json.dumps(notification(alert()) | {"alerts": []}).encode(), "alerts: empty"),
    (json.dumps(notification(alert(), {**alert(), "labels": {"run": "r1"}})).encode(),
     "alerts[1].labels.alertname: missing"),
    (json.dumps(notification(_without(alert(), "fingerprint"))).encode(), "alerts[0].fingerprint: missing"),
    (json.dumps(notification(alert(), alert(), alert(status="pending"))).encode(),
     "alerts[2].status: expected firing or resolved, got 'pending'"),
    (json.dumps(notification(alert(starts_at="yesterday"))).encode(), "alerts[0].startsAt: not an RFC 3339 time"),
    (json.dumps(notification({**alert(), "labels": {"alertname": "X", "n": 1}})).encode(),
     "alerts[0].labels.n: expected a string, got int"),
])
def test_malformed_payloads_are_400_with_the_path_and_change_nothing(serve, body, message):
    with pytest.raises(PayloadError, match="^" + re.escape(message)):
        parse_payload(body)
    trigger = RecordingTrigger()
    s = serve(trigger)
    response = s.post(None, content=body)
    assert response.status_code == 400 and response.json()["error"].startswith(message)
    assert trigger.calls == [] and s.receiver.store.incidents() == []
    assert [(d["event"], d["http_status"]) for d in s.decisions()] == [("rejected", 400)]


def test_a_body_over_one_mebibyte_is_413_before_it_is_read(serve):
    trigger = RecordingTrigger()
    s = serve(trigger)
    conn = http.client.HTTPConnection("127.0.0.1", s.server.server_address[1], timeout=30)
    conn.putrequest("POST", "/alerts")
    conn.putheader("Authorization", f"Bearer {TOKEN}")
    conn.putheader("Content-Length", str((1 << 20) + 1))
    conn.endheaders()  # and no body: the receiver must answer without waiting for it
    assert conn.getresponse().status == 413
    conn.close()
    assert trigger.calls == [] and s.receiver.store.incidents() == []


# --- auth ---------------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong-token-but-long-enough"},
    {"Authorization": f"Bearer {TOKEN}x"},
    {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": "Bearer"},
])
def test_no_or_wrong_token_is_401_and_nothing_is_recorded_or_triggered(serve, headers, caplog):
    trigger = RecordingTrigger()
    s = serve(trigger)
    with caplog.at_level(logging.INFO, logger="rlhf.receiver"):
        response = s.post(notification(alert()), token=None, **headers)
    assert response.status_code == 401 and response.headers["WWW-Authenticate"].startswith("Bearer")
    assert trigger.calls == [] and s.receiver.store.incidents() == []
    [rejection] = s.decisions()
    assert rejection["event"] == "rejected" and rejection["http_status"] == 401
    assert rejection["client"].startswith("127.0.0.1:")
    logged = (s.receiver.state_dir / "receiver-decisions.jsonl").read_text() + caplog.text
    assert TOKEN not in logged and "wrong-token" not in logged


def test_healthz_needs_no_token_and_other_paths_are_404(serve):
    s = serve(RecordingTrigger())
    assert httpx.get(f"{s.url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{s.url}/alerts").status_code == 404
    assert httpx.post(f"{s.url}/other", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404


# --- actions and deduplication --------------------------------------------------------------

def test_a_firing_rollback_alert_triggers_one_rollback(serve):
    trigger = RecordingTrigger()
    s = serve(trigger)
    response = s.post(notification(alert()))
    assert response.status_code == 200
    assert trigger.calls == [(RUN_INCIDENT, KL_SUMMARY, "alertmanager:rlhf-receiver")]
    assert response.json()["results"] == [{"incident": RUN_INCIDENT, "action": "rollback", "result": "triggered",
                                           "flow_run_id": "flow-run-1"}]
    [row] = s.receiver.store.incidents()
    assert (row["incident"], row["action"], row["status"], row["outcome"], row["flow_run_id"]) == (
        RUN_INCIDENT, "rollback", "done", "triggered", "flow-run-1")
    [decision] = s.decisions()
    assert decision["event"] == "accepted" and decision["flow_run_id"] == "flow-run-1"
    assert decision["runbook_url"] == "docs/runbooks/PolicyKLExplosion.md" and decision["replay"] is False


def test_a_replayed_notification_triggers_once(serve):
    trigger = RecordingTrigger()
    s = serve(trigger)
    responses = [s.post(notification(alert())) for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert len(trigger.calls) == 1
    assert [r.json()["results"][0]["result"] for r in responses] == ["triggered", "duplicate", "duplicate"]
    assert [(d["event"], d["replay"]) for d in s.decisions()] == [
        ("accepted", False), ("deduplicated", True), ("deduplicated", True)]


def test_two_identical_requests_at_once_trigger_once(serve):
    trigger = RecordingTrigger(delay=0.3)  # the first call is still running when the second arrives
    s = serve(trigger)
    barrier = threading.Barrier(2)
    responses = []

    def post():
        barrier.wait()
        responses.append(s.post(notification(alert())))

    threads = [threading.Thread(target=post) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in responses] == [200, 200]
    assert len(trigger.calls) == 1
    assert sorted(r.json()["results"][0]["result"] for r in responses) == ["duplicate", "triggered"]


def test_the_same_alert_in_another_group_triggers_once(serve):
    trigger = RecordingTrigger()
    s = serve(trigger)
    assert s.post(notification(alert())).status_code == 200
    other = s.post(notification(alert(), group_key='{}:{alertname="PolicyKLExplosion", run="r1", stage="policy"}'))
    assert other.status_code == 200 and other.json()["results"][0]["result"] == "duplicate"
    assert len(trigger.calls) == 1
    assert s.decisions()[-1]["replay"] is False  # new to that group, still the same incident


def test_rollback_alerts_new_in_one_notification_start_one_rollback(serve):
    trigger = RecordingTrigger()
    s = serve(trigger)
    # alerts that name no run: each is its own incident, and one notification starts one rollback
    kl = alert(summary=KL_SUMMARY)
    tripped = alert("TrainingCircuitBreakerTripped", fingerprint="0f0f0f0f0f0f0f0f", summary="breaker tripped")
    for a in (kl, tripped):
        del a["labels"]["run"], a["labels"]["stage"]
    response = s.post(notification(kl, tripped))
    [(incident, reason, _)] = trigger.calls
    assert incident == KL_INCIDENT and reason.startswith(KL_SUMMARY)
    assert "TrainingCircuitBreakerTripped-0f0f0f0f0f0f0f0f-20261122T092844Z" in reason
    assert [r["result"] for r in response.json()["results"]] == ["triggered", f"covered by {KL_INCIDENT}"]
    assert {row["status"] for row in s.receiver.store.incidents()} == {"done"}
    s.post(notification(kl, tripped))
    assert len(trigger.calls) == 1


def test_alerts_about_one_run_in_separate_notifications_start_one_rollback(serve):
    trigger = RecordingTrigger()
    s = serve(trigger)
    s.post(notification(alert()))
    tripped = alert("TrainingCircuitBreakerTripped", fingerprint="0f0f0f0f0f0f0f0f", summary="breaker tripped",
                    starts_at="2026-11-22T09:29:30Z")
    assert s.post(notification(tripped)).status_code == 200
    assert [c[0] for c in trigger.calls] == [RUN_INCIDENT]


def test_a_notify_alert_is_recorded_and_never_triggers(serve, caplog):
    trigger = RecordingTrigger()
    s = serve(trigger)
    imbalance = alert("TrainingWorkerImbalance", action="notify", severity="warning",
                      summary="Run r1 (policy): worker throughput spread 62%")
    with caplog.at_level(logging.INFO, logger="rlhf.receiver"):
        for _ in range(2):
            assert s.post(notification(imbalance)).status_code == 200
    assert trigger.calls == []
    [row] = s.receiver.store.incidents()
    assert (row["action"], row["status"], row["outcome"]) == ("notify", "recorded", "notified")
    assert [d["event"] for d in s.decisions()] == ["accepted", "deduplicated"]
    [line] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert json.loads(line.getMessage())["runbook_url"] == "docs/runbooks/TrainingWorkerImbalance.md"


def test_a_resolved_notification_is_recorded_and_never_triggers(serve):
    trigger = RecordingTrigger()
    s = serve(trigger)
    response = s.post(notification(alert(status="resolved")))
    assert response.status_code == 200 and trigger.calls == []
    [row] = s.receiver.store.incidents()
    assert (row["incident"], row["action"], row["status"]) == (KL_INCIDENT, "resolved", "recorded")


def test_a_failed_trigger_is_500_then_retried_once_and_then_never_again(serve):
    trigger = RecordingTrigger(fail=1)
    s = serve(trigger)
    first = s.post(notification(alert()))
    assert first.status_code == 500 and "ConnectionError" in first.json()["results"][0]["error"]
    [row] = s.receiver.store.incidents()
    assert row["status"] == "failed" and row["outcome"].startswith("error: ConnectionError")
    retry = s.post(notification(alert()))
    assert retry.status_code == 200 and retry.json()["results"][0]["flow_run_id"] == "flow-run-2"
    for _ in range(2):
        assert s.post(notification(alert())).status_code == 200
    assert len(trigger.calls) == 2
    [row] = s.receiver.store.incidents()
    assert (row["status"], row["attempts"], row["flow_run_id"]) == ("done", 2, "flow-run-2")
    assert [d["event"] for d in s.decisions()] == ["failed", "accepted", "deduplicated", "deduplicated"]


def test_a_claim_left_pending_by_a_dead_receiver_is_retried_only_after_it_goes_stale(serve, tmp_path):
    now = [1000.0]
    trigger = RecordingTrigger()
    s = serve(trigger, retry_pending_after=60, clock=lambda: now[0])
    payload = parse_payload(json.dumps(notification(alert())).encode())
    s.receiver.store.claim(decide(payload.alerts[0], "rlhf-receiver"), "PolicyKLExplosion", payload.group_key,
                           "rlhf-receiver", retry_pending_after=60)  # ...and the process died here
    now[0] += 30
    assert s.post(notification(alert())).json()["results"][0]["result"] == "duplicate"
    now[0] += 31
    assert s.post(notification(alert())).json()["results"][0]["result"] == "triggered"
    assert len(trigger.calls) == 1


CLAIM_AND_DIE = """
import json, os, signal, sys
from monitoring.receiver import Store, decide, parse_payload
payload = parse_payload(sys.stdin.buffer.read())
Store(sys.argv[1]).claim(decide(payload.alerts[0], "rlhf-receiver"), "PolicyKLExplosion", payload.group_key,
                         "rlhf-receiver", retry_pending_after=3600)
os.kill(os.getpid(), signal.SIGKILL)  # between the claim and the rollback's start
"""


def test_a_claim_left_pending_by_a_killed_receiver_process_is_retried_on_the_next_delivery(serve, tmp_path):
    """A receiver SIGKILLed after claiming a rollback and before starting it: the restarted
    receiver's next delivery acts at once (the claim's owner process is gone), not after the
    claim TTL, and exactly once."""
    import subprocess
    import sys

    trigger = RecordingTrigger()
    s = serve(trigger, retry_pending_after=3600)
    body = json.dumps(notification(alert())).encode()
    died = subprocess.run([sys.executable, "-c", CLAIM_AND_DIE, str(s.receiver.store.path)], input=body,
                          cwd=Path(__file__).resolve().parents[2])
    assert died.returncode == -9
    [row] = s.receiver.store.incidents()
    assert row["status"] == "pending" and row["owner"].split(":")[1] != str(os.getpid())
    assert s.post(notification(alert())).json()["results"][0]["result"] == "triggered"
    assert s.post(notification(alert())).json()["results"][0]["result"] == "duplicate"
    assert len(trigger.calls) == 1
    [row] = s.receiver.store.incidents()
    assert (row["status"], row["attempts"]) == ("done", 2)


def test_deduplication_survives_a_restart(serve, tmp_path):
    trigger = RecordingTrigger()
    first = serve(trigger, state_dir=tmp_path / "state")
    first.post(notification(alert()))
    first.stop()
    second = serve(trigger, state_dir=tmp_path / "state")
    response = second.post(notification(alert()))
    assert response.status_code == 200 and response.json()["results"][0]["result"] == "duplicate"
    assert len(trigger.calls) == 1


# --- token --------------------------------------------------------------------------------

def test_token_file_is_stripped_and_weak_or_missing_tokens_refuse_to_start(tmp_path, capsys):
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    path.chmod(0o600)
    assert load_token(path, env={}) == TOKEN
    assert load_token(None, env={"RLHF_RECEIVER_TOKEN": TOKEN + "\n"}) == TOKEN
    for text, message in [("\n", "empty"), ("short-token", "11 characters"), ("has a space in it ok", "printable")]:
        path.write_text(text)
        with pytest.raises(TokenError, match=message):
            load_token(path, env={"RLHF_RECEIVER_TOKEN": TOKEN})  # the file wins over the environment
    with pytest.raises(TokenError, match="cannot read"):
        load_token(tmp_path / "absent", env={})
    with pytest.raises(TokenError, match="no token"):
        load_token(None, env={})
    with pytest.raises(TokenError):
        Receiver("short", tmp_path / "state", RecordingTrigger())
    path.write_text("short-token")
    assert main(["--token-file", str(path), "--state-dir", str(tmp_path / "state"), "--port", "0"]) == 2
    assert "11 characters" in capsys.readouterr().err


# --- the Prefect trigger, against a real temporary Prefect server ---------------------------

@pytest.fixture(scope="module")
def rollback_deployment(prefect_server):
    """The real `rollback` flow deployed (nothing runs it: flow runs stay Scheduled)."""
    from flows.serving import rollback_flow

    deployment_id = rollback_flow.to_deployment(name="rollback").apply()
    return deployment_id


def test_prefect_trigger_starts_the_rollback_deployment_from_a_handler_thread(rollback_deployment, serve):
    from prefect import get_client

    s = serve(PrefectRollbackTrigger("rollback/rollback", config_path="configs/demo.yaml"))
    response = s.post(notification(alert()))
    assert response.status_code == 200, response.text
    flow_run_id = response.json()["results"][0]["flow_run_id"]
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
    assert run.deployment_id == rollback_deployment and run.state.is_scheduled()
    assert run.parameters == {"incident": RUN_INCIDENT, "reason": KL_SUMMARY,
                              "requested_by": "alertmanager:rlhf-receiver", "config_path": "configs/demo.yaml"}
    # The idempotency key: a call retried after a lost answer returns the same flow run.
    trigger = PrefectRollbackTrigger("rollback/rollback", config_path="configs/demo.yaml")
    assert trigger(RUN_INCIDENT, KL_SUMMARY, "alertmanager:rlhf-receiver") == flow_run_id


def test_prefect_trigger_names_a_missing_deployment_and_the_alert_is_retried(prefect_server, serve):
    trigger = PrefectRollbackTrigger("rollback/no-such-deployment")
    with pytest.raises(RollbackTriggerError, match="'rollback/no-such-deployment' not found at http://"):
        trigger("incident-1", "test", "pytest")
    s = serve(trigger)
    response = s.post(notification(alert()))
    assert response.status_code == 500
    [row] = s.receiver.store.incidents()
    assert row["status"] == "failed" and "not found" in row["outcome"]


def test_rollback_alerts_about_one_run_share_one_incident():
    from monitoring.receiver import decide

    def alert(name, fp, starts):
        return {"status": "firing", "fingerprint": fp, "startsAt": starts,
                "labels": {"alertname": name, "action": "rollback", "run": "abc123", "stage": "policy"},
                "annotations": {"summary": f"{name} on abc123"}}

    kl = decide(alert("PolicyKLExplosion", "f1", "2026-11-22T10:00:00Z"), "r")
    trip = decide(alert("TrainingCircuitBreakerTripped", "f2", "2026-11-22T10:00:40Z"), "r")
    assert kl.action == trip.action == "rollback"
    assert kl.incident == trip.incident == "run-abc123-policy"
    other = decide({**alert("PolicyKLExplosion", "f3", "2026-11-22T10:00:00Z"),
                    "labels": {"alertname": "PolicyKLExplosion", "action": "rollback", "run": "zzz", "stage": "policy"}}, "r")
    assert other.incident == "run-zzz-policy"


def test_the_receiver_refuses_to_start_without_prefect_or_the_rollback_deployment(
        rollback_deployment, tmp_path, capsys, free_ports):
    """Started without a reachable Prefect API holding the rollback deployment, the receiver
    would accept alerts it can never act on: it exits 2 naming what is missing."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    path = tmp_path / "token"
    path.write_text("t" * 32)
    args = ["--token-file", str(path), "--state-dir", str(tmp_path / "state"), "--port", "0"]
    PrefectRollbackTrigger("rollback/rollback").check()  # the test server has it: no error

    assert main([*args, "--deployment", "rollback/no-such-deployment"]) == 2
    err = capsys.readouterr().err
    assert "not starting: the Prefect API at http://" in err and "has no deployment 'rollback/no-such-deployment'" in err

    closed = f"http://127.0.0.1:{free_ports(1)[0]}/api"
    with temporary_settings(updates={PREFECT_API_URL: closed}):
        assert main(args) == 2
        assert f"not starting: the Prefect API at {closed} (PREFECT_API_URL) did not answer" in capsys.readouterr().err
        with pytest.raises(RollbackTriggerError, match=f"starting the Prefect deployment 'rollback/rollback' at {closed}"):
            PrefectRollbackTrigger("rollback/rollback")("incident-1", "test", "pytest")

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert main(args) == 2
        assert "not starting: PREFECT_API_URL is not set" in capsys.readouterr().err
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())


# --- stop: a run asked to stop through its MLflow run ----------------------------------------

XID_SUMMARY = "GPU 3 on gpu-node-1 reported XID error 79 under run r1 (policy), rank 3: stopping the run"


def test_decide_maps_a_stop_alert_to_its_run_and_one_without_a_run_to_notify():
    decision = decide(alert("TrainingGpuXidError", action="stop", summary=XID_SUMMARY), "r")
    assert (decision.action, decision.incident, decision.run) == ("stop", RUN_INCIDENT, "r1")
    nameless = alert("TrainingGpuXidError", action="stop")
    del nameless["labels"]["run"]
    assert decide(nameless, "r").action == "notify" and "names no run" in decide(nameless, "r").reason


def test_a_stop_alert_sets_the_request_on_the_runs_mlflow_run_once_and_the_stage_reads_it(serve, tmp_path):
    """Through a real MLflow store: the receiver tags the run named by the alert, a replay
    does not tag it again, and the stage's `StopRequests` reads the reason; a request made
    before a stage started is not that stage's."""
    from mlflow.tracking import MlflowClient

    from monitoring.stop import STOP_TAG, StopRequests, request_stop

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("stop")).info.run_id
    earlier_stage = StopRequests(uri, run_id, poll_s=0)
    calls = []

    def stop(run, reason, requested_by):
        calls.append(run)
        request_stop(uri, run, reason, requested_by)

    s = serve(RecordingTrigger(), request_stop=stop)
    xid = alert("TrainingGpuXidError", action="stop", summary=XID_SUMMARY, run=run_id)
    response = s.post(notification(xid))
    assert response.status_code == 200
    assert response.json()["results"] == [{"incident": f"run-{run_id}-policy", "action": "stop",
                                           "result": "stop requested"}]
    assert s.post(notification(xid)).json()["results"][0]["result"] == "duplicate" and calls == [run_id]
    assert json.loads(client.get_run(run_id).data.tags[STOP_TAG])["reason"] == XID_SUMMARY
    assert earlier_stage() == f"{XID_SUMMARY} (requested by alertmanager:rlhf-receiver)"
    assert StopRequests(uri, run_id, poll_s=0)() is None  # a stage started after the request
    polled = StopRequests(uri, run_id, since=0.0, poll_s=3600)
    assert polled() is not None and polled() is None  # read at most once per poll interval


def test_a_stop_the_receiver_cannot_deliver_is_500_and_retried(serve):
    s = serve(RecordingTrigger())  # started without a tracking URI
    response = s.post(notification(alert("TrainingGpuXidError", action="stop")))
    assert response.status_code == 500 and "without a tracking URI" in response.json()["results"][0]["error"]
    [row] = s.receiver.store.incidents()
    assert (row["action"], row["status"]) == ("stop", "failed")
