"""End to end: training metrics → real Prometheus (rules from infra/) → real Alertmanager →
the webhook receiver → the `rollback` deployment on a Prefect server → champion moved back.

Everything runs on loopback with short intervals: Prometheus scrapes and evaluates every
second, Alertmanager groups after a second, and the rules are a copy of
`infra/prometheus/rules/rlhf.rules.yml` with their `for:` durations and range windows
shortened (the rules themselves, expressions and labels, are the committed ones).
"""
from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "infra" / "prometheus" / "rules" / "rlhf.rules.yml"
ALERTMANAGER_CONFIG = REPO / "infra" / "alertmanager" / "alertmanager.yml"

pytestmark = pytest.mark.slow


def wait_for(what: str, check, timeout: float, every: float = 0.5, diagnose=None):
    """Poll `check` until it returns something truthy; on timeout fail, saying what was
    awaited and, if given, what `diagnose()` reports of the state at that moment."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    detail = ""
    if diagnose:
        try:
            detail = f"; {diagnose()}"
        except Exception as exc:  # noqa: BLE001 - the timeout is the failure; say why there is no detail
            detail = f"; (no diagnosis: {exc!r})"
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")


def short_rules(text: str) -> str:
    """The committed rules with test-sized windows: `for:` 2 s, 1m windows 15 s, 10m windows 1m."""
    text = re.sub(r"for: \d+[smh]", "for: 2s", text)
    return text.replace("[10m]", "[1m]").replace("[5m]", "[30s]").replace("[1m]", "[15s]")


class Stack:
    """Prometheus + Alertmanager + the receiver, started for one test and stopped after."""

    def __init__(self, tools, tmp: Path, trigger, ports: list[int], **receiver_options):
        from monitoring.receiver import Receiver, serve_in_thread

        self.tmp = tmp
        self.targets = tmp / "targets"
        self.targets.mkdir()
        token = secrets.token_urlsafe(24)
        (tmp / "token").write_text(token)
        (tmp / "token").chmod(0o600)
        self.receiver = Receiver(token, tmp / "receiver", trigger, **receiver_options)
        self.receiver_server, _ = serve_in_thread(self.receiver)
        receiver_port = self.receiver_server.server_address[1]

        am = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
        for route in [am["route"], *am["route"].get("routes", [])]:
            route.update(group_wait="1s", group_interval="2s")
        hook = am["receivers"][0]["webhook_configs"][0]
        hook["url"] = f"http://127.0.0.1:{receiver_port}/alerts"
        hook["http_config"]["authorization"]["credentials_file"] = str(tmp / "token")
        (tmp / "alertmanager.yml").write_text(yaml.safe_dump(am))
        self.am_port, self.prom_port = ports
        self.alertmanager = subprocess.Popen(
            [tools.alertmanager, f"--config.file={tmp / 'alertmanager.yml'}", f"--storage.path={tmp / 'am-data'}",
             f"--web.listen-address=127.0.0.1:{self.am_port}", "--cluster.listen-address="],
            stdout=open(tmp / "alertmanager.log", "w"), stderr=subprocess.STDOUT, start_new_session=True,
        )

        (tmp / "rules").mkdir()
        (tmp / "rules" / "rlhf.rules.yml").write_text(short_rules(RULES.read_text()))
        prom = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": [str(tmp / "rules" / "rlhf.rules.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{self.am_port}"]}]}]},
            "scrape_configs": [{"job_name": "rlhf-training",
                                "file_sd_configs": [{"files": [str(self.targets / "*.json")], "refresh_interval": "1s"}]}],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(prom))
        self.prometheus = subprocess.Popen(
            [tools.prometheus, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'prom-data'}",
             f"--web.listen-address=127.0.0.1:{self.prom_port}"],
            stdout=open(tmp / "prometheus.log", "w"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        wait_for("Prometheus and Alertmanager to be ready", self._ready, 60)

    def _ready(self) -> bool:
        try:
            return all(httpx.get(url, timeout=1, trust_env=False).status_code == 200 for url in (
                f"http://127.0.0.1:{self.prom_port}/-/ready", f"http://127.0.0.1:{self.am_port}/-/ready"))
        except httpx.HTTPError:
            return False

    def alerts(self) -> list[dict]:
        """Prometheus' active alerts (pending and firing)."""
        r = httpx.get(f"http://127.0.0.1:{self.prom_port}/api/v1/alerts", timeout=5, trust_env=False)
        return r.json()["data"]["alerts"]

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(f"http://127.0.0.1:{self.prom_port}/api/v1/query", params={"query": expr}, timeout=5,
                      trust_env=False)
        return r.json()["data"]["result"]

    def series(self, expr: str) -> dict[str, str]:
        """{label set: latest value} of an instant query, for failure messages."""
        return {",".join(f"{k}={v}" for k, v in sorted(r["metric"].items()) if k != "__name__"): r["value"][1]
                for r in self.query(expr)}

    def scrape_health(self) -> list[str]:
        r = httpx.get(f"http://127.0.0.1:{self.prom_port}/api/v1/targets", timeout=5, trust_env=False)
        return [f"{t['scrapeUrl']} {t['health']} {t['lastError']!r}".strip() for t in r.json()["data"]["activeTargets"]]

    def firing(self, name: str) -> list[dict]:
        return [a for a in self.alerts() if a["labels"]["alertname"] == name and a["state"] == "firing"]

    def notification_state(self) -> str:
        """What Alertmanager holds and last logged, and what the receiver recorded: for failure messages."""
        held = httpx.get(f"http://127.0.0.1:{self.am_port}/api/v2/alerts", timeout=5, trust_env=False).json()
        log_tail = (self.tmp / "alertmanager.log").read_text().splitlines()[-8:]
        return (f"alertmanager holds {[(a['labels'].get('alertname'), a['status']['state']) for a in held]}; "
                f"its log ends {log_tail}; the receiver recorded {self.decisions()}")

    def decisions(self) -> list[dict]:
        import json

        path = self.tmp / "receiver" / "receiver-decisions.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def close(self) -> None:
        for proc in (self.prometheus, self.alertmanager):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.receiver_server.shutdown()
        self.receiver_server.server_close()


@pytest.fixture
def stack_factory(monitoring_tools, tmp_path, free_ports):
    stacks = []

    def make(trigger, **receiver_options):
        stacks.append(Stack(monitoring_tools, tmp_path / f"stack{len(stacks)}", trigger, free_ports(2),
                            **receiver_options))
        return stacks[-1]

    (tmp_path / "stack0").mkdir()
    (tmp_path / "stack1").mkdir()
    yield make
    for s in stacks:
        s.close()


# ------------------------------------------------------------------------------------------
# instability -> alert -> receiver -> rollback deployment -> champion moved back


def registry_with_two_champions(tracking_uri: str, tmp: Path) -> MlflowClient:
    """`policy` v1 then v2 promoted (so v2 is champion and remembers v1)."""
    from tasks.registry import POLICY, promote, register_model_version

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("tests") or client.get_experiment(
        client.create_experiment("tests", artifact_location=(tmp / "mlartifacts").as_uri()))
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text("{}")
    for version in ("1", "2"):
        run = client.create_run(exp.experiment_id)
        client.log_artifacts(run.info.run_id, str(tmp / "model"), "model")
        register_model_version(client, POLICY, run.info.run_id, "model", {"gate.passed": "true"})
        promote(client, version, "pytest", "setup")
    return client


@pytest.fixture
def rollback_runner(prefect_server):
    """The real `rollback` flow served as `rollback/e2e-rollback` by a runner process polling
    the test's Prefect server every second."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_RUNNER_POLL_FREQUENCY": "1",
           "PYTHONPATH": str(REPO)}
    code = "from flows.serving import rollback_flow; rollback_flow.serve(name='e2e-rollback')"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def deployed():
        from prefect import get_client

        with get_client(sync_client=True) as client:
            try:
                return client.read_deployment_by_name("rollback/e2e-rollback")
            except Exception:  # noqa: BLE001 - not registered yet
                return None

    wait_for("the rollback deployment", deployed, 120, every=1)
    yield "rollback/e2e-rollback"
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(30)


# The rollback alerts of the committed rules that watch training metrics, each by a sign no
# later than its condition (the rules' windows and `for:` durations aside).
SIGNS = (
    "PolicyKLExplosion", "TrainingNonFiniteLoss", "TrainingCircuitBreakerTripped", "PolicyEntropyCollapse",
    "PolicyRewardCollapse", "PolicyOverOptimisation",
)
SIGN_KEYS = ("policy/kl", "policy/nonfinite_skipped", "policy/circuit_breaker_tripped", "policy/entropy",
             "policy/reward_mean", "policy/rm_score_mean", "policy/audit_score_mean", "policy/ensemble_disagreement")


def first_unstable_step(client: MlflowClient, run_id: str, kl_bound: float) -> tuple[str, int, float]:
    """(the alert, the step, its Unix time) of the first step of a policy run that showed a sign
    some rollback alert watches. A step logged twice counts from its first record."""
    steps: dict[int, dict] = {}
    for key in SIGN_KEYS:
        for metric in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
            steps.setdefault(metric.step, {}).setdefault(key, metric)
    first: dict[str, float] = {}
    peak = float("-inf")
    for step, metrics in sorted(steps.items()):
        v = {key: metric.value for key, metric in metrics.items()}
        first = {**v, **first}
        peak = max(peak, v.get("policy/reward_mean", peak))
        shown = {
            "PolicyKLExplosion": not v.get("policy/kl", 0.0) <= kl_bound,  # NaN counts
            "TrainingNonFiniteLoss": v.get("policy/nonfinite_skipped", 0.0) > 0,
            "TrainingCircuitBreakerTripped": v.get("policy/circuit_breaker_tripped", 0.0) == 1,
            "PolicyEntropyCollapse": not v.get("policy/entropy", 1.0) >= 0.05,
            "PolicyRewardCollapse": peak - v.get("policy/reward_mean", peak) > 0.5 * max(abs(peak), 0.2),
            "PolicyOverOptimisation": v.get("policy/ensemble_disagreement", 0.0) > 0.5 or (
                v.get("policy/rm_score_mean", 0.0) - first.get("policy/rm_score_mean", 0.0) > 0.1
                and v.get("policy/audit_score_mean", 0.0) - first.get("policy/audit_score_mean", 0.0) < -0.1),
        }
        for alert in SIGNS:
            if shown[alert]:
                return alert, step, min(m.timestamp for m in metrics.values()) / 1000
    raise AssertionError(f"no step of run {run_id} shows a sign of instability: {steps}")


def test_an_unstable_run_fires_an_alert_that_rolls_the_champion_back(
    stack_factory, rollback_runner, ray_cluster, tiny_config_factory, tmp_path
):
    from prefect import get_client

    from flows.pipeline import rlhf_pipeline
    from monitoring.receiver import PrefectRollbackTrigger
    from tasks.registry import CHAMPION, POLICY, by_alias
    from tasks.summary import PipelineFailed

    raw = tiny_config_factory(tmp_path)
    raw["policy"].update(learning_rate=50.0, steps=8, kl_bound=0.5, checkpoint_every=1, eval_every=8,
                         circuit_breaker={"kl_patience": 2})  # the injected instability: an absurd step size
    raw["serving"] = {"enabled": False}  # the rollback moves the alias; this test starts no vLLM server
    raw["monitoring"] = {"targets_dir": str(tmp_path / "stack0" / "targets"), "linger_on_failure_s": 15}
    config = tmp_path / "unstable.yaml"
    config.write_text(yaml.safe_dump(raw))
    client = registry_with_two_champions(raw["tracking"]["tracking_uri"], tmp_path)
    stack = stack_factory(PrefectRollbackTrigger(rollback_runner, config_path=str(config)))

    with pytest.raises(PipelineFailed) as exc:
        rlhf_pipeline(config_path=str(config))
    summary = exc.value.summary
    assert summary["failed_stage"] == "policy" and "circuit breaker" in summary["error"]

    def rolled_back():
        champion = by_alias(client, CHAMPION, POLICY)
        return champion is not None and str(champion.version) == "1"

    wait_for("champion to move back to v1", rolled_back, 180, every=1)
    [decision] = [d for d in stack.decisions() if d.get("action") == "rollback" and d.get("result") == "triggered"]
    assert decision["requested_by"] == "alertmanager:rlhf-receiver"
    with get_client(sync_client=True) as prefect:
        flow_run = prefect.read_flow_run(decision["flow_run_id"])
        flow_run = wait_for("the rollback flow run to complete",
                            lambda: (r := prefect.read_flow_run(decision["flow_run_id"])).state.is_completed() and r, 60)
    assert flow_run.parameters["incident"].startswith("run-")

    # the registry says why and at whose request; the same incident again does nothing
    stage_runs = client.search_runs([client.get_run(summary["mlflow_run_id"]).info.experiment_id],
                                    "tags.stage = 'policy'")
    policy_run = next(r for r in stage_runs if r.data.tags.get("mlflow.parentRunId") == summary["mlflow_run_id"])
    assert policy_run.info.status == "FAILED" and policy_run.data.tags["circuit_breaker.reason"] in (
        "kl_above_bound", "nonfinite_loss")
    # the breaker stopped the stage at the trip and kept a checkpoint from before it; no policy is saved
    tags = policy_run.data.tags
    tripped_at = int(tags["circuit_breaker.step"])
    assert tripped_at < raw["policy"]["steps"] and "circuit breaker:" in summary["error"]
    assert f"last good checkpoint: {tags['circuit_breaker.checkpoint']}" in summary["error"]
    assert tags["circuit_breaker.checkpoint"] != "none" and Path(tags["circuit_breaker.checkpoint"]).is_dir()
    assert sorted({m.step for m in client.get_metric_history(policy_run.info.run_id, "policy/kl")}) == list(
        range(1, tripped_at + 1))  # it stopped at the trip
    [flag] = client.get_metric_history(policy_run.info.run_id, "policy/circuit_breaker_tripped")
    assert (flag.step, flag.value) == (tripped_at, 1.0)  # raised at the tripping step only
    models = Path(summary["output_dir"]) / "models"
    assert (models / "reward" / "model.safetensors").is_file() and not (models / "policy" / "model.safetensors").exists()
    v1 = client.get_model_version(POLICY, "1").tags
    assert v1["rollback.requested_by"] == "alertmanager:rlhf-receiver"
    assert v1["rollback.incident"] == flow_run.parameters["incident"] == f"run-{policy_run.info.run_id}-policy"

    # seconds from the first unstable step to the completed rollback. Which rollback alert fires
    # first depends on the machine: a skipped non-finite step (TrainingNonFiniteLoss, no `for:`)
    # can come a step before KL crosses its bound, so the clock starts at the first step that
    # shows any sign a rollback alert of the committed rules watches.
    assert decision["alertname"] in SIGNS, decision
    sign, step, started = first_unstable_step(client, policy_run.info.run_id, raw["policy"]["kl_bound"])
    seconds = flow_run.end_time.timestamp() - started
    print(f"\nfirst unstable step {step} ({sign}); alert {decision['alertname']} -> rollback completed: "
          f"{seconds:.1f} s")
    assert 0 < seconds < 300


# ------------------------------------------------------------------------------------------
# proxy score up, audit score down -> over-optimisation alert -> receiver asks for a rollback


def test_a_run_hacking_its_reward_model_fires_the_over_optimisation_alert_and_asks_for_a_rollback(
    stack_factory, tmp_path
):
    """Two runs' figures pushed through the exporter, as the rank-0 sink sends them: in one the
    proxy score rises while the audit score falls, in the other both rise. Only the first fires."""
    from monitoring.prometheus import JobExporter

    triggered = []
    stack = stack_factory(lambda incident, reason, by: triggered.append((incident, by)) or "flow-run-hack")
    targets = tmp_path / "stack0" / "targets"
    hacking, honest = JobExporter("hacking-run", "policy", targets_dir=targets), JobExporter(
        "honest-run", "policy", targets_dir=targets)
    sinks, step = (hacking.sink(), honest.sink()), 0

    def push_and_check():
        nonlocal step
        step += 1
        proxy, audit = 0.05 * step, -0.05 * step  # 0.1 a second at one push each 0.5 s
        sinks[0](step, {"policy/rm_score_mean": proxy, "policy/audit_score_mean": audit,
                        "policy/ensemble_disagreement": 0.1})
        sinks[1](step, {"policy/rm_score_mean": proxy, "policy/audit_score_mean": proxy,
                        "policy/ensemble_disagreement": 0.1})
        return [d for d in stack.decisions() if d.get("alertname") == "PolicyOverOptimisation"
                and d.get("result") == "triggered"]

    try:
        [decision] = wait_for("the receiver to act on PolicyOverOptimisation", push_and_check, 90,
                              diagnose=lambda: (
                                  f"proxy delta {stack.series('run_stage:rlhf_policy_proxy_score:delta5m')}, "
                                  f"audit delta {stack.series('run_stage:rlhf_policy_audit_score:delta5m')}, "
                                  f"alerts {[(a['labels'], a['state']) for a in stack.alerts()]}, "
                                  f"targets {stack.scrape_health()}, decisions {stack.decisions()}"))
        over = [a for a in stack.alerts() if a["labels"]["alertname"] == "PolicyOverOptimisation"]
    finally:
        hacking.close()
        honest.close()
    assert decision["action"] == "rollback" and decision["run"] == "hacking-run"
    assert decision["runbook_url"] == "docs/runbooks/PolicyOverOptimisation.md"
    assert triggered == [("run-hacking-run-policy", "alertmanager:rlhf-receiver")]
    assert {a["labels"]["run"] for a in over} == {"hacking-run"}  # both scores rising: not even pending


# ------------------------------------------------------------------------------------------
# a rank's GPU nearly full -> GPU memory alert naming the rank -> the receiver tells a person


def test_a_rank_whose_gpu_is_nearly_full_fires_the_gpu_memory_alert_naming_it_and_nothing_is_rolled_back(
    stack_factory, tmp_path
):
    """Two GPU runs' worker figures pushed through the exporter as the rank-0 sink sends them
    (the sampler's NVML readings: no GPU here): in one, rank 1's GPU is 97% full. Only that run
    and rank fire, and the receiver notifies without starting anything."""
    from monitoring.prometheus import JobExporter

    triggered = []
    stack = stack_factory(lambda incident, reason, by: triggered.append(incident) or "flow-run-never")
    targets = tmp_path / "stack0" / "targets"
    full, roomy = JobExporter("full-run", "policy", targets_dir=targets), JobExporter(
        "roomy-run", "policy", targets_dir=targets)
    step = 0

    def figures(used_by_rank: list[float]) -> dict:
        out = {}
        for rank, used in enumerate(used_by_rank):
            out |= {f"worker/{rank}/host": f"gpu-node-{rank}", f"worker/{rank}/gpu_uuid": f"GPU-{rank:04d}",
                    f"worker/{rank}/gpu_memory_used_bytes": used, f"worker/{rank}/gpu_memory_total_bytes": 80e9,
                    f"worker/{rank}/gpu_utilization": 0.9}
        return out

    def push_and_check():
        nonlocal step
        step += 1
        full.sink()(step, figures([60e9, 77.6e9]))
        roomy.sink()(step, figures([60e9, 70e9]))
        return [d for d in stack.decisions() if d.get("alertname") == "TrainingGpuMemoryNearLimit"]

    try:
        [decision, *_] = wait_for("the receiver to hear TrainingGpuMemoryNearLimit", push_and_check, 90,
                                  diagnose=lambda: (f"alerts {[(a['labels'], a['state']) for a in stack.alerts()]}, "
                                                    f"targets {stack.scrape_health()}, decisions {stack.decisions()}"))
        firing = stack.firing("TrainingGpuMemoryNearLimit")
    finally:
        full.close()
        roomy.close()
    assert decision["action"] == "notify" and decision["run"] == "full-run"
    assert decision["runbook_url"] == "docs/runbooks/TrainingGpuMemoryNearLimit.md"
    assert {(a["labels"]["run"], a["labels"]["rank"], a["labels"]["host"]) for a in firing} == {
        ("full-run", "1", "gpu-node-1")}
    assert triggered == []  # a notify alert starts nothing


# ------------------------------------------------------------------------------------------
# users turn unhappy with a newly served version -> satisfaction alert -> rollback asked for

def test_users_unhappy_with_a_new_champion_fire_the_satisfaction_alert_and_ask_for_a_rollback(
    stack_factory, tmp_path, free_ports
):
    """A real feedback gateway (`rlhf gateway`, SQLite store) scraped by the stack's Prometheus.
    Users rate v1's answers mostly up; v2 replaces v1 (blue/green, as `current.json` and
    `deployments.jsonl` record it) and its users rate mostly down. The answers are recorded in
    the store directly, as the gateway records what vLLM serves: no model is needed to rate."""
    from rlhf_core.feedback.store import Answer, FeedbackStore, sqlite_url
    from rlhf_core.serving.state import Endpoint, append_history, write_json_atomic
    from rlhf_core.serving.user_auth import USER_SECRET_FILE, sign_user
    from rlhf_core.testing.gateway_process import running_gateway

    def endpoint(version: str) -> Endpoint:
        return Endpoint(url="http://127.0.0.1:9", host="127.0.0.1", port=9, pid=1,
                        served_model_name=f"policy-v{version}", version=version, model_dir="/m", log_path="/l",
                        started_at="2024-01-01T00:00:00+00:00")

    state = tmp_path / "serving"
    state.mkdir()
    append_history(state, "deployed", endpoint("1"), None)
    write_json_atomic(state / "current.json", endpoint("1").to_dict())
    store = FeedbackStore(sqlite_url(state / "feedback.db"))
    for version in ("1", "2"):
        for i in range(100):
            store.record_response(f"v{version}-{i}", model_version=version, served_model=f"policy-v{version}",
                                  kind="completion", prompt=f"{i}+1=", user_hash=f"asker{i}", answers_=[Answer("x")])
    store.close()

    triggered = []
    stack = stack_factory(lambda incident, reason, by: triggered.append((incident, reason)) or "flow-run-unhappy")
    port = free_ports(1)[0]
    # the API key and the user-signing secret from the state dir: unset variables name them
    # nowhere else, whatever the environment holds
    sets = [f"output_dir={tmp_path}", f"serving.state_dir={state}", f"feedback.port={port}",
            "serving.api_key_env=RLHF_TEST_UNSET_KEY", "feedback.user_secret_env=RLHF_TEST_UNSET_USER_SECRET",
            "feedback.ratings_per_minute=100000"]
    with running_gateway([a for s in sets for a in ("--set", s)], port) as gateway:
        (tmp_path / "stack0" / "targets" / "gateway.json").write_text(
            f'[{{"targets": ["127.0.0.1:{port}"], "labels": {{"job_run": "gateway"}}}}]')
        key = (state / "api_key").read_text().strip()
        user_secret = (state / USER_SECRET_FILE).read_text().strip()  # generated as the gateway started

        def rate(version: str, ups: int, downs: int) -> None:
            """Ratings as an application sends them: the API key, each user's id signed."""
            with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=10, trust_env=False) as c:
                for i in range(ups + downs):
                    r = c.post(f"{gateway}/v1/feedback", headers=sign_user(user_secret, f"u{i}"),
                               json={"response_id": f"v{version}-{i}", "rating": "up" if i < ups else "down"})
                    assert r.status_code == 200, r.text

        rate("1", 80, 20)  # happy with v1
        wait_for("Prometheus to scrape v1's thumbs", lambda: stack.series(
            'role:rlhf_feedback_thumbs:count{role="current"}') == {"role=current": "100"}, 30)
        assert not stack.firing("ChampionSatisfactionDrop")
        append_history(state, "deployed", endpoint("2"), endpoint("1"))  # v2 replaces v1
        write_json_atomic(state / "current.json", endpoint("2").to_dict())
        rate("2", 20, 40)  # and its users are unhappy

        def acted():
            return [d for d in stack.decisions() if d.get("alertname") == "ChampionSatisfactionDrop"
                    and d.get("result") == "triggered"]

        [decision] = wait_for("the receiver to act on ChampionSatisfactionDrop", acted, 90, diagnose=lambda: (
            f"shares {stack.series('role:rlhf_feedback_thumbs_up:share')}, "
            f"counts {stack.series('role:rlhf_feedback_thumbs:count')}, "
            f"alerts {[(a['labels'], a['state']) for a in stack.alerts()]}, targets {stack.scrape_health()}"))
    assert decision["action"] == "rollback" and decision["runbook_url"] == "docs/runbooks/ChampionSatisfactionDrop.md"
    [(incident, reason)] = triggered
    assert incident.startswith("ChampionSatisfactionDrop-") and "46.67% (absolute)" in reason  # 0.8 - 1/3


# ------------------------------------------------------------------------------------------
# a throttled worker -> imbalance alert -> recorded, no rollback


def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of a process (threads created later inherit it)."""
    for thread in psutil.Process(pid).threads():
        os.sched_setaffinity(thread.id, cpus)


def busiest_processes(n: int = 6) -> list[str]:
    """The `n` processes that used the most CPU over the next second, for failure messages."""
    procs = list(psutil.process_iter(["pid", "name", "cmdline"]))
    for proc in procs:
        try:
            proc.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(1)
    usage = []
    for proc in procs:
        try:
            usage.append((proc.cpu_percent(None), proc.info["pid"], " ".join(proc.info["cmdline"] or [proc.info["name"]])[:80]))
        except psutil.Error:
            pass
    return [f"{pct:.0f}% {pid} {cmd}" for pct, pid, cmd in sorted(usage, reverse=True)[:n]]


def noisy_neighbours(cpu: int, n: int = 3) -> list[subprocess.Popen]:
    """`n` busy loops pinned to `cpu`: a worker pinned there gets about 1/(n+1) of it, as on
    an oversubscribed node. SIGSTOP duty cycles would not do: they land between the short
    forward passes, not inside them, and the worker's compute time hardly changes."""
    code = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def test_a_throttled_worker_fires_the_imbalance_alert_and_nothing_is_rolled_back(
    stack_factory, ray_cluster, tmp_path
):
    from monitoring.prometheus import JobExporter
    from rlhf_core.config import RewardConfig
    from rlhf_core.distributed.reward_trainer import train_reward_model
    from rlhf_core.training.stage_types import StageSite
    from rlhf_core.config import DemoDataConfig
    from rlhf_core.data.schema import read_table
    from rlhf_core.data.synthetic import generate_demo_data

    triggered = []
    stack = stack_factory(lambda incident, reason, by: triggered.append(incident) or "never")
    stack_dir = tmp_path / "stack0"
    files = generate_demo_data(DemoDataConfig(n_sft=10, n_pairs=1200, n_eval=10), tmp_path / "data")
    pairs = read_table(files.preferences)[["prompt", "chosen", "rejected"]].to_dict("records")
    base = _tiny_base(tmp_path)
    # long enough (about a minute) for Prometheus to see the spread over its window; once the
    # alert is recorded the rest of the training proves nothing, and the test stops it (no retry)
    cfg = RewardConfig(num_workers=2, micro_batch_size=8, epochs=12, checkpoint_every=10_000, min_eval_accuracy=0.0,
                       warmup_steps=2, max_failures=0)
    exporter = JobExporter("imbalance-run", "reward", targets_dir=stack_dir / "targets")
    neighbours: list[subprocess.Popen] = []
    result: dict = {}
    stop = tmp_path / "stop-training"
    sink = StopWhenTold(exporter.sink(), stop)

    def train():
        try:
            result["r"] = train_reward_model(pairs[:1100], pairs[1100:], base, cfg,
                                             StageSite(tmp_path / "rm", tmp_path / "ray", "imbalance", sink))
        except Exception as exc:  # noqa: BLE001 - checked below: only the test's own stop is expected
            result["error"] = exc

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        # the exporter learns each worker's pid from the figures rank 0 sends; throttle rank 1
        pids = wait_for("the workers' first figures",
                        lambda: len(exporter.workers) == 2 and all("pid" in w for w in exporter.workers.values())
                        and {r: int(w["pid"]) for r, w in exporter.workers.items()}, 180)
        pin(pids["0"], {1})
        pin(pids["1"], {0})
        neighbours.extend(noisy_neighbours(cpu=0))
        alert = wait_for("TrainingWorkerImbalance to fire",
                         lambda: stack.firing("TrainingWorkerImbalance") or (not trainer.is_alive() and ["done"]), 240,
                         diagnose=lambda: (
                             f"trainer alive {trainer.is_alive()}, pinned pids {pids}, "
                             f"imbalance ratio {stack.series('run_stage:rlhf_worker_samples_per_second:imbalance_ratio1m')}, "
                             f"samples/s {stack.series('rlhf_worker_samples_per_second')}, "
                             f"affinity {({r: sorted(os.sched_getaffinity(int(p))) for r, p in pids.items()})}, "
                             f"targets {stack.scrape_health()}, busiest processes {busiest_processes()}"))
        seen = {} if alert != ["done"] else {  # how far the throttle got over the run, and what else was busy then
            **{q: stack.series(q) for q in (
                "max_over_time(run_stage:rlhf_worker_samples_per_second:imbalance_ratio1m[5m])",
                "run_stage:rlhf_worker_samples_per_second:imbalance_ratio1m",
                "min_over_time(rlhf_worker_samples_per_second[5m])", "max_over_time(rlhf_worker_samples_per_second[5m])")},
            "busiest processes": busiest_processes()}
        assert alert != ["done"], f"training ended before the imbalance alert fired: {seen}"
        assert alert[0]["labels"]["action"] == "notify" and alert[0]["labels"]["run"] == "imbalance-run"
        # Alertmanager posts within seconds once it has the alert; on a 2-core machine whose one core
        # the busy loops hold, the post and the receiver's thread in this process have taken over 60 s
        wait_for("the receiver to record it", lambda: any(
            d.get("alertname") == "TrainingWorkerImbalance" and d.get("action") == "notify" for d in stack.decisions()),
            120, diagnose=stack.notification_state)
    finally:
        stop.touch()
        for proc in neighbours:
            proc.kill()
        trainer.join(600)
        exporter.finish(ok=True)
        exporter.close()
    assert "r" in result or StopWhenTold.MESSAGE in str(result["error"]), result  # no other failure
    assert triggered == []  # an imbalance is for a person: no rollback
    assert not stack.firing("TrainingCircuitBreakerTripped")


class StopWhenTold:
    """A metrics sink (rank 0 calls it at each step) that passes the figures on, then ends the
    training with an error once `stop_file` exists."""

    MESSAGE = "stopped by the test: the alert it waited for was recorded"

    def __init__(self, sink, stop_file: Path):
        self.sink, self.stop_file = sink, stop_file

    def __call__(self, step: int, metrics: dict) -> None:
        self.sink(step, metrics)
        if self.stop_file.exists():
            raise RuntimeError(self.MESSAGE)


def _tiny_base(tmp: Path) -> Path:
    from rlhf_core.config import ModelConfig
    from rlhf_core.models.llama import build_policy, save_pretrained_atomic
    from rlhf_core.tokenizer import train_tokenizer

    tok = train_tokenizer([f"{a:02d}+{b:02d}={a + b:03d}" for a in range(100) for b in range(100)], vocab_size=64)
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2)
    return save_pretrained_atomic(build_policy(cfg, tok, seed=0), tok, tmp / "base")


# ------------------------------------------------------------------------------------------
# an XID error on a rank's GPU -> XID alert naming the run -> the receiver asks the run to stop


def test_an_xid_error_on_a_ranks_gpu_asks_that_run_to_stop_through_its_mlflow_run(stack_factory, tmp_path):
    """DCGM's XID series (served as the exporter serves it: no GPU here) reports error 79 on the
    GPU of rank 1 of one run; another run computes on other GPUs. The alert joins the two on the
    GPU's UUID, names the run and rank, and the receiver sets the stop request on that run's
    MLflow run only (`monitoring.stop`), which the run's stage reads between steps."""
    import json
    from functools import partial

    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    from monitoring.prometheus import JobExporter
    from monitoring.stop import STOP_TAG, StopRequests, request_stop

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("xid")
    faulty, healthy = (client.create_run(experiment).info.run_id for _ in range(2))
    since = time.time()
    triggered = []
    stack = stack_factory(lambda incident, reason, by: triggered.append(incident) or "flow-run-never",
                          request_stop=partial(request_stop, uri))
    registry = CollectorRegistry()
    xid = Gauge("DCGM_FI_DEV_XID_ERRORS", "last XID", ["gpu", "UUID", "Hostname"], registry=registry)
    xid.labels("1", "GPU-0001", "gpu-node-0").set(79)
    xid.labels("0", "GPU-0000", "gpu-node-0").set(0)
    dcgm, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    (stack.targets / "dcgm.json").write_text(json.dumps([{"targets": [f"127.0.0.1:{dcgm.server_port}"]}]))
    exporters = {run: JobExporter(run, "policy", targets_dir=stack.targets) for run in (faulty, healthy)}
    gpus = {faulty: ["GPU-0000", "GPU-0001"], healthy: ["GPU-0100", "GPU-0101"]}
    step = 0

    def push_and_check():
        nonlocal step
        step += 1
        for run, exporter in exporters.items():
            exporter.sink()(step, {f"worker/{rank}/{k}": v for rank, uuid in enumerate(gpus[run]) for k, v in (
                ("host", f"gpu-node-{rank}"), ("gpu_uuid", uuid), ("gpu_utilization", 0.9))})
        return [d for d in stack.decisions() if d.get("alertname") == "TrainingGpuXidError"]

    try:
        [decision, *_] = wait_for("the receiver to hear TrainingGpuXidError", push_and_check, 90,
                                  diagnose=lambda: (f"alerts {[(a['labels'], a['state']) for a in stack.alerts()]}, "
                                                    f"targets {stack.scrape_health()}, decisions {stack.decisions()}"))
        firing = stack.firing("TrainingGpuXidError")
    finally:
        for exporter in exporters.values():
            exporter.close()
        dcgm.shutdown()
    assert decision["action"] == "stop" and decision["run"] == faulty and decision["result"] == "stop requested"
    assert {(a["labels"]["run"], a["labels"]["rank"], a["labels"]["UUID"]) for a in firing} == {
        (faulty, "1", "GPU-0001")}
    request = json.loads(client.get_run(faulty).data.tags[STOP_TAG])
    assert request["reason"].startswith("GPU 1 on gpu-node-0 reported XID error 79 under run")
    assert STOP_TAG not in client.get_run(healthy).data.tags
    assert StopRequests(uri, faulty, since, poll_s=0)().endswith("(requested by alertmanager:rlhf-receiver)")
    assert triggered == []  # a stop rolls nothing back
