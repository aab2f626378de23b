"""The alerting configuration in `infra/`: Prometheus rules and their promtool unit tests, the
Prometheus and Alertmanager configs, and one runbook per alert in `docs/runbooks/`.

The real tools check the files: `promtool check rules`, `promtool test rules`, `promtool
check config`, `amtool check-config`. When `promtool` is missing and the tests run as root,
the `monitoring_tools` fixture installs Debian's `prometheus` and `prometheus-alertmanager`
packages (no service is started); otherwise it fails saying how to install them.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO / "infra" / "prometheus"
RULES = PROMETHEUS_DIR / "rules" / "rlhf.rules.yml"
RULE_TESTS = PROMETHEUS_DIR / "rules" / "rlhf.rules.test.yml"
PROMETHEUS_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
ALERTMANAGER_CONFIG = REPO / "infra" / "alertmanager" / "alertmanager.yml"
RUNBOOKS = REPO / "docs" / "runbooks"

# The committed prometheus.yml reads training targets from here; the config test points it
# at a temporary directory holding a sample targets file.
TARGETS_DIR = "/var/lib/rlhf/prometheus-targets"

REQUIRED_LABELS = {"severity": {"critical", "warning"}, "action": {"rollback", "stop", "notify"}}
REQUIRED_ANNOTATIONS = ("summary", "description", "runbook_url")
RUNBOOK_SECTIONS = ("Meaning", "Likely causes", "What happens automatically", "What to do", "Silencing", "Escalation")


def _alerts() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


ALERTS = {rule["alert"]: rule for rule in _alerts()}


# --- the tools --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def amtool(monitoring_tools) -> str:
    return monitoring_tools.amtool


def _run(*cmd: str | Path, cwd: Path = REPO) -> str:
    """Run a checker; fail the test with its output unless it exits 0."""
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(map(str, cmd))} exited {result.returncode}:\n{output}"
    return output


# --- promtool and amtool ----------------------------------------------------------------


def test_rules_pass_promtool_check(monitoring_tools):
    output = _run(monitoring_tools.promtool, "check", "rules", RULES)
    assert "SUCCESS" in output


def test_rules_pass_their_promtool_unit_tests(monitoring_tools):
    output = _run(monitoring_tools.promtool, "test", "rules", RULE_TESTS)
    assert "SUCCESS" in output and "FAILED" not in output


def test_prometheus_config_passes_promtool_check(monitoring_tools, tmp_path):
    """A copy of infra/prometheus with the targets directory moved into tmp, holding a file
    like the ones training jobs write, so that promtool also checks the file_sd format."""
    text = PROMETHEUS_CONFIG.read_text()
    assert f"{TARGETS_DIR}/*.json" in text, "the config test rewrites this path; keep them in step"
    copy = tmp_path / "prometheus"
    shutil.copytree(PROMETHEUS_DIR, copy)
    targets = tmp_path / "targets"
    targets.mkdir()
    (targets / "policy-run123.json").write_text(  # as monitoring/prometheus.py writes it
        '[{"targets": ["127.0.0.1:41234"], "labels": {"job_run": "run123", "job_stage": "policy"}}]'
    )
    (copy / "prometheus.yml").write_text(text.replace(TARGETS_DIR, str(targets)).replace("../../runs/prometheus-targets", str(targets)))

    output = _run(monitoring_tools.promtool, "check", "config", copy / "prometheus.yml")

    assert "WARNING" not in output, output
    assert "rlhf.rules.yml" in output  # the rules were found through rule_files and checked
    assert "rlhf.rules.test.yml" not in output  # the unit tests are not loaded as rules


def test_alertmanager_config_passes_amtool_check(amtool):
    output = _run(amtool, "check-config", ALERTMANAGER_CONFIG)
    assert "SUCCESS" in output


@pytest.mark.parametrize("labels", [
    ["alertname=PolicyKLExplosion", "action=rollback", "severity=critical", "run=r1", "stage=policy"],
    ["alertname=ServingDown", "action=notify", "severity=critical", "job=vllm"],
    ["alertname=TrainingGpuXidError", "action=stop", "severity=critical", "run=r1", "stage=policy", "UUID=GPU-1"],
])
def test_alertmanager_routes_every_alert_to_the_receiver(amtool, labels):
    output = _run(amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER_CONFIG}", *labels)
    assert output.splitlines()[0].strip() == "rlhf-receiver"


# --- the files, read in Python ----------------------------------------------------------


def test_prometheus_config_scrapes_training_and_both_serving_ports():
    cfg = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert cfg["global"]["scrape_interval"] == "5s"
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    assert jobs["rlhf-training"]["file_sd_configs"][0]["files"] == [f"{TARGETS_DIR}/*.json", "../../runs/prometheus-targets/*.json"]
    vllm_targets = {t for sc in jobs["vllm"]["static_configs"] for t in sc["targets"]}
    assert vllm_targets == {"127.0.0.1:8100", "127.0.0.1:8101"}
    assert jobs["vllm"].get("metrics_path", "/metrics") == "/metrics"
    from rlhf_core.config import FeedbackConfig

    gateway_targets = {t for sc in jobs["rlhf-feedback"]["static_configs"] for t in sc["targets"]}
    assert gateway_targets == {f"{FeedbackConfig().host}:{FeedbackConfig().port}"}
    assert cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["127.0.0.1:9093"]
    assert sorted(p.name for p in PROMETHEUS_DIR.glob(cfg["rule_files"][0])) == ["rlhf.rules.yml"]


def test_alertmanager_sends_resolved_alerts_with_a_token_from_a_file():
    cfg = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    assert cfg["route"]["receiver"] == "rlhf-receiver"
    assert cfg["route"]["group_by"] == ["alertname", "run", "stage"]
    (receiver,) = [r for r in cfg["receivers"] if r["name"] == "rlhf-receiver"]
    (webhook,) = receiver["webhook_configs"]
    assert webhook["url"] == "http://127.0.0.1:8900/alerts"
    assert webhook["send_resolved"] is True
    auth = webhook["http_config"]["authorization"]
    assert auth["credentials_file"] and "credentials" not in auth  # never the token itself


def test_inhibit_rules_name_existing_alerts():
    cfg = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    named = set()
    for rule in cfg["inhibit_rules"]:
        for matcher in rule["source_matchers"] + rule["target_matchers"]:
            match = re.fullmatch(r'alertname=~?"([^"]+)"', matcher)
            if match:
                named.update(match.group(1).split("|"))
    assert named and named <= set(ALERTS), named - set(ALERTS)


@pytest.mark.parametrize("name", sorted(ALERTS))
def test_alert_has_severity_action_and_annotations(name):
    rule = ALERTS[name]
    for label, allowed in REQUIRED_LABELS.items():
        assert rule.get("labels", {}).get(label) in allowed, f"{name}: label {label} must be one of {sorted(allowed)}"
    for annotation in REQUIRED_ANNOTATIONS:
        assert rule.get("annotations", {}).get(annotation, "").strip(), f"{name}: annotation {annotation} is missing"


@pytest.mark.parametrize("name", sorted(ALERTS))
def test_alert_runbook_url_names_its_runbook(name):
    url = ALERTS[name]["annotations"]["runbook_url"]
    assert url == f"docs/runbooks/{name}.md"
    assert (REPO / url).is_file(), f"{name}: {url} does not exist"


@pytest.mark.parametrize("name", sorted(ALERTS))
def test_alert_has_a_firing_and_a_quiet_unit_test(name):
    """Every alert has a promtool case where it fires, with all its labels and annotations
    spelled out, and one where it must stay quiet."""
    cases = [case for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
             for case in test.get("alert_rule_test", []) if case["alertname"] == name]
    firing = [alert for case in cases for alert in case["exp_alerts"]]
    assert firing, f"{name}: no unit test where it fires"
    assert any(not case["exp_alerts"] for case in cases), f"{name}: no unit test where it stays quiet"
    for alert in firing:
        assert set(REQUIRED_LABELS) <= set(alert["exp_labels"]), f"{name}: a firing case does not check the labels"
        assert set(REQUIRED_ANNOTATIONS) <= set(alert["exp_annotations"]), f"{name}: a firing case skips annotations"


def test_every_runbook_belongs_to_an_alert():
    assert {p.stem for p in RUNBOOKS.glob("*.md")} == set(ALERTS)


@pytest.mark.parametrize("name", sorted(ALERTS))
def test_runbook_has_every_section(name):
    text = (RUNBOOKS / f"{name}.md").read_text()
    assert text.startswith(f"# {name}\n")
    headings = re.findall(r"^## (.+?)\s*$", text, flags=re.MULTILINE)
    missing = [s for s in RUNBOOK_SECTIONS if s not in headings]
    assert not missing, f"{name}.md lacks sections {missing}"
    for section, body in zip(headings, re.split(r"^## .+$", text, flags=re.MULTILINE)[1:]):
        assert body.strip(), f"{name}.md: section {section!r} is empty"
    action = ALERTS[name]["labels"]["action"]
    assert f"`{action}`" in text, f"{name}.md does not say what action={action} does"
