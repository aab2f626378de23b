from mlflow.tracking import MlflowClient

from tasks.registry import register_model_version


def test_each_registration_is_a_new_version_with_its_lineage(tmp_path, mlflow_store):
    client = MlflowClient(mlflow_store)
    exp = client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    versions = []
    for i in range(2):
        run = client.create_run(exp)
        client.log_artifacts(run.info.run_id, str(tmp_path / "model"), "model")
        versions.append(register_model_version(client, "reward-model", run.info.run_id, "model", {"dataset.fingerprint": f"sha256:{i}"}))
    assert versions == ["1", "2"]
    v2 = client.get_model_version("reward-model", "2")
    assert v2.tags["dataset.fingerprint"] == "sha256:1"
    assert v2.source.endswith("/model")
    # a stage killed after registering and run again registers the same source once
    again = register_model_version(client, "reward-model", run.info.run_id, "model", {"dataset.fingerprint": "sha256:x"})
    assert again == "2" and len(client.search_model_versions("name = 'reward-model'")) == 2
    assert client.get_model_version("reward-model", "2").tags["dataset.fingerprint"] == "sha256:x"


# -- aliases, promotion and rollback bookkeeping (a real MLflow SQLite store) ------------------

import pytest  # noqa: E402

from rlhf_core.serving.errors import ServingError  # noqa: E402
from tasks.registry import (  # noqa: E402
    CHALLENGER, CHAMPION, POLICY, RegistryError, by_alias, complete_rollback, incident_record, plan_rollback,
    promote, start_rollback,
)


@pytest.fixture
def registry(tmp_path, mlflow_store):
    """`policy` with versions 1-3 (all passed the gates) and no aliases."""
    client = MlflowClient(mlflow_store)
    exp = client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    for _ in range(3):
        run = client.create_run(exp)
        client.log_artifacts(run.info.run_id, str(tmp_path / "model"), "model")
        register_model_version(client, POLICY, run.info.run_id, "model", {"gate.passed": "true"})
    return client


def champion(client) -> str | None:
    v = by_alias(client, CHAMPION)
    return None if v is None else str(v.version)


def test_promotion_records_the_previous_champion(registry):
    first = promote(registry, "1", "alice", "first release")
    assert (first.version, first.previous, first.changed) == ("1", None, True)
    registry.set_registered_model_alias(POLICY, CHALLENGER, "2")
    second = promote(registry, "challenger", "bob", "better win rate")
    assert (second.version, second.previous) == ("2", "1")
    assert champion(registry) == "2" and by_alias(registry, CHALLENGER) is None  # the challenger won
    tags = registry.get_model_version(POLICY, "2").tags
    assert tags["previous_champion"] == "1" and tags["promoted_by"] == "bob" and tags["promotion_reason"] == "better win rate"
    again = promote(registry, "2", "bob", "again")
    assert not again.changed and again.previous == "1"


def test_a_retried_registration_that_set_challenger_again_leaves_the_champion_alone(registry):
    promote(registry, "2", "pipeline", "gates.auto_promote")
    registry.set_registered_model_alias(POLICY, CHALLENGER, "2")  # what register does before promoting
    again = promote(registry, "2", "pipeline", "gates.auto_promote", expected_champion=None)
    assert not again.changed and registry.get_registered_model(POLICY).aliases == {CHAMPION: 2}


def test_promotion_refuses_a_rejected_version_unless_forced(registry):
    registry.set_model_version_tag(POLICY, "3", "gate.passed", "false")
    registry.set_model_version_tag(POLICY, "3", "gate.reasons", "kl_above_max: KL to reference 12 > max 10")
    with pytest.raises(RegistryError, match="the gates did not pass policy v3 \\(rejected: kl_above_max"):
        promote(registry, "3", "carol", "hotfix")
    registry.set_model_version_tag(POLICY, "3", "gate.status", "undecided")  # undecided: refused the same way
    with pytest.raises(RegistryError, match="the gates did not pass policy v3 \\(undecided: "):
        promote(registry, "3", "carol", "hotfix")
    assert champion(registry) is None
    promote(registry, "3", "carol", "hotfix", force=True)
    assert "forced past a gate rejection" in registry.get_model_version(POLICY, "3").tags["promotion_reason"]


def test_a_promotion_expecting_another_champion_is_refused_and_changes_nothing(registry):
    """Two runs evaluated against v1; the first promotes v2; the second, expecting v1, is told."""
    promote(registry, "1", "alice", "v1")
    promote(registry, "2", "run-a", "gates.auto_promote", expected_champion="1")
    with pytest.raises(RegistryError, match="not promoting policy v3: champion is v2, not v1 as expected"):
        promote(registry, "3", "run-b", "gates.auto_promote", expected_champion="1")
    assert champion(registry) == "2" and "promoted_by" not in registry.get_model_version(POLICY, "3").tags
    with pytest.raises(RegistryError, match="champion is v2, not none"):
        promote(registry, "3", "run-b", "first", expected_champion=None)


def test_unknown_versions_and_aliases_are_named(registry):
    with pytest.raises(RegistryError, match="no version 9"):
        promote(registry, "9", "a", "r")
    with pytest.raises(RegistryError, match="no version has the alias 'champion'"):
        promote(registry, "champion", "a", "r")


@pytest.mark.parametrize(
    "current, previous, to_version, existing, expected",
    [
        ("3", "2", None, None, ("move", "3", "2")),
        ("3", "2", "1", None, ("move", "3", "1")),  # an explicit target wins
        ("3", None, "1", None, ("move", "3", "1")),
        ("3", "2", None, {"status": "completed", "from": "3", "to": "2"}, ("none", "3", "2")),
        ("2", "1", None, {"status": "moved", "from": "3", "to": "2"}, ("redeploy", "3", "2")),  # the redeploy failed
        # killed after recording its intent: before the alias moved, and after
        ("3", "2", None, {"status": "moving", "from": "3", "to": "2"}, ("move", "3", "2")),
        ("2", "1", None, {"status": "moving", "from": "3", "to": "2"}, ("move", "3", "2")),
    ],
)
def test_plan_rollback(current, previous, to_version, existing, expected):
    assert plan_rollback(current, previous, to_version, existing, "INC-1") == expected


@pytest.mark.parametrize(
    "current, previous, to_version, match",
    [
        (None, None, None, "no champion to roll back"),
        ("3", None, None, "no recorded previous champion; name the version"),
        ("3", "2", "3", "v3 already is the champion"),
    ],
)
def test_plan_rollback_refuses(current, previous, to_version, match):
    with pytest.raises(RegistryError, match=match):
        plan_rollback(current, previous, to_version, None, "INC-1")


def test_rollback_moves_champion_back_once_per_incident(registry):
    promote(registry, "1", "alice", "v1")
    promote(registry, "2", "alice", "v2")
    plan = start_rollback(registry, "fp-abc123", "KL explosion on v2", "alertmanager:rlhf")
    assert (plan.action, plan.from_version, plan.to_version) == ("move", "2", "1")
    assert champion(registry) == "1"
    v1 = registry.get_model_version(POLICY, "1").tags
    assert v1["rollback.incident"] == "fp-abc123" and v1["rollback.requested_by"] == "alertmanager:rlhf"
    assert incident_record(registry, "fp-abc123")["status"] == "moved"

    retry = start_rollback(registry, "fp-abc123", "KL explosion on v2", "alertmanager:rlhf")
    assert retry.action == "redeploy" and champion(registry) == "1"  # the alias does not move twice
    complete_rollback(registry, retry, served_version="1")
    done = start_rollback(registry, "fp-abc123", "replayed", "someone")
    assert done.action == "none" and champion(registry) == "1"
    assert incident_record(registry, "fp-abc123")["reason"] == "KL explosion on v2"  # the replay changed nothing


def test_a_rollback_killed_between_alias_move_and_record_is_finished_by_its_retry(registry, monkeypatch):
    """Killed after moving champion and before recording the move: the retry finishes that
    move (one incident, one move), and does not move the alias again to the version before."""
    promote(registry, "1", "alice", "v1")
    promote(registry, "2", "alice", "v2")
    promote(registry, "3", "alice", "v3")
    moves: list[str] = []
    real_set_alias = registry.set_registered_model_alias
    monkeypatch.setattr(registry, "set_registered_model_alias",
                        lambda name, alias, version: (moves.append(str(version)), real_set_alias(name, alias, version)))
    real_tag = registry.set_model_version_tag

    def killed(*args):
        raise KeyboardInterrupt("SIGKILL stands in here: the process ends between the move and its record")

    monkeypatch.setattr(registry, "set_model_version_tag", killed)
    with pytest.raises(KeyboardInterrupt):
        start_rollback(registry, "INC-9", "error rate", "alertmanager:rlhf")
    assert champion(registry) == "2" and incident_record(registry, "INC-9")["status"] == "moving"

    monkeypatch.setattr(registry, "set_model_version_tag", real_tag)
    retry = start_rollback(registry, "INC-9", "retried", "someone")
    assert (retry.action, retry.from_version, retry.to_version) == ("move", "3", "2")
    assert champion(registry) == "2" and moves == ["2"]  # one move, not a second one to v1
    record = incident_record(registry, "INC-9")
    assert record["status"] == "moved" and record["reason"] == "error rate"  # the first request's record
    assert registry.get_model_version(POLICY, "3").tags["rolled_back_by_incident"] == "INC-9"
    assert [k for k in registry.get_registered_model(POLICY).tags if k.startswith("incident.")] == ["incident.INC-9"]


def test_a_rollback_refuses_when_champion_moved_since_its_intent_was_recorded(registry):
    promote(registry, "1", "alice", "v1")
    promote(registry, "2", "alice", "v2")
    from tasks.registry import record_incident
    record_incident(registry, "INC-7", {"incident": "INC-7", "from": "2", "to": "1", "reason": "r",
                                        "requested_by": "x", "requested_at": "t", "status": "moving"})
    promote(registry, "3", "bob", "a hotfix, meanwhile")
    with pytest.raises(RegistryError, match="interrupted moving champion from v2 to v1, and champion is now v3"):
        start_rollback(registry, "INC-7", "r", "x")
    assert champion(registry) == "3"


def test_incident_ids_are_checked(registry):
    promote(registry, "1", "a", "r")
    with pytest.raises(RegistryError, match="incident id 'a b'"):
        start_rollback(registry, "a b", "r", "x")


def test_fetch_version_reads_the_given_store_not_the_process_wide_one(registry, tmp_path):
    """Regression: `models:/` URIs resolve against the process-wide registry URI, so a deploy
    started by `rlhf promote --deploy` looked for `policy` in the wrong store."""
    import mlflow

    from tasks.registry import fetch_version

    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'another-store.db'}")
    try:
        model = fetch_version(registry.tracking_uri, "2", tmp_path / "models")
    finally:
        mlflow.set_tracking_uri(previous)
    assert model == tmp_path / "models" / "v2" and (model / "config.json").is_file()
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["v2"]  # no temporary directory left
    assert fetch_version(registry.tracking_uri, "2", tmp_path / "models") == model  # downloaded once


def test_a_deploy_that_finds_the_champion_moved_during_its_turn_serves_the_new_one(registry, monkeypatch, tmp_path):
    """The bookkeeping of `deploy_champion` when another run promotes while it serves: which
    version it serves next. The serving itself (vLLM) is the serving tests' business; here
    `_serve` records the version and, on its first call, is overtaken by another promotion."""
    from prefect.logging import disable_run_logger

    from rlhf_core.config import load_config
    from rlhf_core.config.default import DEFAULT_CONFIG
    from tasks import deploy

    cfg = load_config(DEFAULT_CONFIG, [f"tracking.tracking_uri={registry.tracking_uri}", f"output_dir={tmp_path}"])
    promote(registry, "1", "run a", "test")
    served = []

    def serve(client, champion, cfg, log):
        served.append(str(champion.version))
        if len(served) == 1:
            promote(client, "2", "run b", "test")  # the other run, meanwhile
        return deploy.Deployment(str(champion.version), "http://127.0.0.1:1", "m", "p", "t",
                                 served[-2] if len(served) > 1 else None, True, 1.0, "K")

    monkeypatch.setattr(deploy, "_serve", serve)
    with disable_run_logger():
        d = deploy.deploy_champion.fn(cfg)
    assert served == ["1", "2"] and d.version == "2" and d.previous_version is None and d.changed

    def restless(client, champion, cfg, log):  # a champion that never settles is reported, not chased
        served.append(str(champion.version))
        promote(client, "3" if champion.version == 2 else "2", "someone", "test")
        return deploy.Deployment(str(champion.version), "u", "m", "p", "t", None, True, 1.0, "K")

    monkeypatch.setattr(deploy, "_serve", restless)
    with disable_run_logger(), pytest.raises(ServingError, match="the champion moved 3 times during one deploy"):
        deploy.deploy_champion.fn(cfg)


# -- who may be promoted: the rule, then through the registry ---------------------------------

from tasks.registry import check_promotion  # noqa: E402

ROLLED_BACK = {"gate.passed": "true", "rolled_back_by_incident": "INC-1"}
INCIDENT = {"requested_at": "2024-05-01T10:00:00+00:00", "reason": "KL explosion"}


@pytest.mark.parametrize(
    "tags, force, reason, refusal, overridden",
    [
        ({"gate.passed": "true"}, False, None, None, ()),
        ({"gate.passed": "false"}, False, "r", "the gates did not pass policy v2", ()),
        ({"gate.passed": "false"}, True, None, None, ("a gate rejection",)),  # the gates: force alone suffices
        (ROLLED_BACK, False, "r", ("policy v2 was rolled back (incident INC-1, 2024-05-01T10:00:00+00:00, KL explosion); "
                                   "promote it again only on purpose: `rlhf promote 2 --force --reason TEXT`"), ()),
        (ROLLED_BACK, True, None, "a forced promotion of it needs a reason", ()),
        (ROLLED_BACK, True, "  ", "a forced promotion of it needs a reason", ()),
        (ROLLED_BACK, True, "fixed upstream", None, ("the rollback of incident INC-1",)),
        ({**ROLLED_BACK, "gate.passed": "false"}, True, "r", None, ("a gate rejection", "the rollback of incident INC-1")),
    ],
)
def test_check_promotion(tags, force, reason, refusal, overridden):
    check = check_promotion(POLICY, "2", tags, INCIDENT, force=force, reason=reason)
    if refusal is None:
        assert check.refusal is None
    else:
        assert check.refusal is not None and refusal in check.refusal, check.refusal
    assert check.overridden == overridden


def test_a_rolled_back_version_is_promoted_again_only_when_forced_with_a_reason(registry):
    """v2 was rolled back for an incident: promoting it again is refused, forcing it without a
    reason too; forced with a reason it is the champion and the reason is on the version."""
    promote(registry, "1", "alice", "v1")
    promote(registry, "2", "alice", "v2")
    start_rollback(registry, "INC-5", "reward collapse on v2", "alertmanager:rlhf")
    assert champion(registry) == "1"

    with pytest.raises(RegistryError, match=r"policy v2 was rolled back \(incident INC-5, .*, reward collapse on v2\)"):
        promote(registry, "2", "bob", "looks fine to me")
    with pytest.raises(RegistryError, match="a forced promotion of it needs a reason"):
        promote(registry, "2", "bob", None, force=True)
    assert champion(registry) == "1" and registry.get_model_version(POLICY, "2").tags["promoted_by"] == "alice"

    p = promote(registry, "2", "bob", "the reward bug is fixed upstream", force=True)
    assert (p.version, p.previous, p.changed) == ("2", "1", True) and champion(registry) == "2"
    tags = registry.get_model_version(POLICY, "2").tags
    assert tags["promoted_by"] == "bob"
    assert tags["promotion_reason"] == "the reward bug is fixed upstream (forced past the rollback of incident INC-5)"
    assert not promote(registry, "2", "carol", None).changed  # the champion again: nothing to refuse, nothing changes


def test_champion_version_tells_no_champion_from_an_unreadable_store(registry, free_ports, monkeypatch):
    from tasks.registry import champion_version

    empty = MlflowClient(registry.tracking_uri.replace("m.db", "empty.db"))
    assert champion_version(empty) is None  # no registered model
    assert champion_version(registry) is None  # no champion alias
    promote(registry, "2", "alice", "v2")
    assert champion_version(registry) == "2"
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    down = MlflowClient(f"http://127.0.0.1:{free_ports(1)[0]}")  # nothing listens there
    with pytest.raises(RegistryError, match="cannot read policy@champion from the registry"):
        champion_version(down)


# -- a canary in the registry: the call, the evidence, the alert's incident ---------------------

def test_a_canary_ends_as_its_call_says_with_the_evidence_and_its_alert_is_handled_once(registry, monkeypatch,
                                                                                       tmp_path):
    """The canary's bookkeeping: its call from the store, the tags and alias moves, and the
    rollback flow for the canary's own alert, twice. Ending the servers is the serving tests'
    business (test_canary.py, and with real servers test_gateway_serving.py)."""
    import json

    from prefect.logging import disable_run_logger

    from flows.serving import rollback_flow
    from rlhf_core.config import load_config
    from rlhf_core.config.default import DEFAULT_CONFIG
    from rlhf_core.feedback.store import Answer, FeedbackStore, sqlite_url
    from rlhf_core.serving import canary, server
    from rlhf_core.serving.state import Endpoint, write_json_atomic
    from tasks import canary as canary_tasks

    state = tmp_path / "serving"
    sets = [f"tracking.tracking_uri={registry.tracking_uri}", f"output_dir={tmp_path}", f"serving.state_dir={state}",
            "serving.canary.min_ratings=20"]
    cfg = load_config(DEFAULT_CONFIG, sets)
    promote(registry, "1", "test", "first")
    registry.set_registered_model_alias(POLICY, CHALLENGER, "2")

    def endpoint(version, port):
        return Endpoint(f"http://127.0.0.1:{port}", "127.0.0.1", port, 0, f"policy-v{version}", version, "/m", "", "t")

    state.mkdir()
    write_json_atomic(state / "current.json", endpoint("1", 8100).to_dict())
    started = canary.start_record(state, endpoint("2", 8101), endpoint("1", 8100), 0.5)
    store = FeedbackStore(sqlite_url(state / "feedback.db"))
    for version, ups in (("1", 25), ("2", 5)):
        for i in range(30):
            rid = f"{version}-{i}"
            store.record_response(rid, model_version=version, served_model="m", kind="completion", prompt="p",
                                  user_hash=f"u{i}", answers_=[Answer("a")])
            store.rate(rid, f"u{i}", thumb=1 if i < ups else -1)
    store.close()
    retired = []
    monkeypatch.setattr(server, "end_canary", lambda d, action, c: canary.finish_canary(
        d, action, 1.0, "k", lambda e, key, t: retired.append(e.version)))

    assert canary_tasks.canary_call(cfg)[1].action == "roll_back"
    with pytest.raises(RegistryError, match="the canary's call is roll_back, not promote: .* give --reason"):
        canary_tasks.end_canary(cfg, "promote", "carol")
    assert canary.read_canary(state) == started and champion(registry) == "1"

    incident = "CanaryWorse-0123abcd-20261207T090000Z"
    with disable_run_logger():
        first = rollback_flow.fn(incident, "canary worse", "alertmanager:rlhf", overrides=sets)
    assert (first["action"], first["from_version"], first["to_version"]) == ("canary_rolled_back", "2", "1")
    assert retired == ["2"] and canary.read_canary(state) is None and champion(registry) == "1"
    tags = registry.get_model_version(POLICY, "2").tags
    assert tags["canary.decision"] == "roll_back" and tags["canary.decided_by"] == "alertmanager:rlhf"
    assert json.loads(tags["canary.thumbs"]) == {"champion": [25, 30], "canary": [5, 30]}
    assert by_alias(registry, CHALLENGER) is None
    assert incident_record(registry, incident)["action"] == "canary_roll_back"
    assert canary_tasks.incident_handled(cfg, incident) and canary_tasks.canary_incident(incident)
    assert not canary_tasks.canary_incident("ChampionSatisfactionDrop-0123abcd-20261207T090000Z")
    with disable_run_logger():  # the alert sent again: handled, nothing moves
        again = rollback_flow.fn(incident, "canary worse", "alertmanager:rlhf", overrides=sets)
    assert again["action"] == "none" and champion(registry) == "1" and retired == ["2"]
