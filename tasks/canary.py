"""A canary in the registry and in serving: start one from a registered version, read its call
from users' thumbs, and end it, moving the aliases with the evidence on the version's tags.

- `start_canary`: serves a version beside the champion for `serving.canary.share` of the users
  (`rlhf_core.serving.canary`); it holds the `challenger` alias while it runs.
- `canary_call`: the always-valid test's call now, from the feedback store.
- `end_canary`: `promote` makes the version the champion (`tasks.registry.promote`, refused as a
  promotion is, and only while the champion is still the one it was compared with) and then
  gives it all the users; `roll_back` gives every user back to the champion and drops its
  `challenger` alias. The call, who made it and the thumbs of both versions are set as
  `canary.*` tags on the version; an incident (the `CanaryWorse` alert through the receiver's
  rollback flow) is recorded as the registry records rollbacks, so a repeated alert does nothing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mlflow.tracking import MlflowClient
from prefect import task

from rlhf_core.config import PipelineConfig
from rlhf_core.eval.always_valid import Decision
from rlhf_core.feedback.store import FeedbackStore
from rlhf_core.serving import server
from rlhf_core.serving.canary import Canary, canary_arms, decide_canary, read_canary
from rlhf_core.serving.gateway import store_url
from tasks.registry import (
    CHALLENGER, CHAMPION, RegistryError, by_alias, fetch_version, get_version, incident_record, now_iso, promote,
    record_incident,
)
from tasks.tracking import resolve_tracking_uri


@dataclass(frozen=True)
class CanaryEnd:
    version: str
    action: str  # promote | roll_back
    serving: str  # the version that serves all users after
    reason: str

    def summary(self) -> dict:
        return {"canary": self.version, "action": self.action, "serving": self.serving, "reason": self.reason}


def _state_dir(cfg: PipelineConfig) -> Path:
    return server.state_dir_for(cfg.serving, cfg.output_dir)


def start_canary(cfg: PipelineConfig, version: str) -> Canary:
    """Serve `version` as the canary of the champion that serves now."""
    client, name = MlflowClient(resolve_tracking_uri(cfg)), cfg.tracking.registered_model
    target = get_version(client, version, name)
    champion = by_alias(client, CHAMPION, name)
    state_dir = _state_dir(cfg)
    serving = server.current_endpoint(state_dir)
    if champion is None or serving is None or serving.version != str(champion.version):
        raise RegistryError(f"a canary of {name} v{target.version} needs the champion serving beside it "
                            f"(champion: {'v' + str(champion.version) if champion else 'none'}, serving: "
                            f"{'v' + serving.version if serving else 'nothing'}); `rlhf deploy` serves the champion")
    if str(target.version) == str(champion.version):
        raise RegistryError(f"{name} v{target.version} already is the champion")
    model_dir = fetch_version(client.tracking_uri, str(target.version), state_dir / "models", name)
    server.deploy(model_dir, str(target.version), cfg.serving, state_dir,
                  served_model_name=f"{name}-v{target.version}", canary_share=cfg.serving.canary.share)
    client.set_registered_model_alias(name, CHALLENGER, str(target.version))
    for key, value in {"canary.started_at": now_iso(), "canary.share": f"{cfg.serving.canary.share:g}",
                       "canary.champion": str(champion.version)}.items():
        client.set_model_version_tag(name, str(target.version), key, value)
    return read_canary(state_dir)


def canary_call(cfg: PipelineConfig) -> tuple[Canary, Decision]:
    """The running canary and its call now; RegistryError when none runs."""
    canary = read_canary(_state_dir(cfg))
    if canary is None:
        raise RegistryError("no canary is running")
    store = FeedbackStore(store_url(cfg))
    try:
        return canary, decide_canary(store, canary, cfg.serving.canary)
    finally:
        store.close()


def end_canary(cfg: PipelineConfig, action: str, requested_by: str, reason: str | None = None,
               incident: str | None = None) -> CanaryEnd:
    """End the running canary by `action`; without `reason`, the test's call must be `action`
    (`reason` overrides it: a person's decision, recorded as such)."""
    canary, decision = canary_call(cfg)
    if reason is None and decision.action != action:
        raise RegistryError(f"the canary's call is {decision.action}, not {action}: {decision.reason}; "
                            "give --reason to decide otherwise")
    why = reason or decision.reason
    client, name, version = MlflowClient(resolve_tracking_uri(cfg)), cfg.tracking.registered_model, canary.endpoint.version
    store = FeedbackStore(store_url(cfg))
    try:
        champion_arm, canary_arm = canary_arms(store, canary)
    finally:
        store.close()
    if action == "promote":
        promote(client, version, requested_by, f"canary: {why}", name=name, expected_champion=canary.champion_version)
    serving = server.end_canary(_state_dir(cfg), action, cfg.serving)
    if action == "roll_back" and (challenger := by_alias(client, CHALLENGER, name)) is not None \
            and str(challenger.version) == version:
        client.delete_registered_model_alias(name, CHALLENGER)
    evidence = {"canary.decision": action, "canary.reason": why[:5000], "canary.decided_by": requested_by,
                "canary.decided_at": now_iso(), "canary.test_call": decision.action,
                "canary.thumbs": json.dumps({"champion": [champion_arm.up, champion_arm.n],
                                             "canary": [canary_arm.up, canary_arm.n]})}
    for key, value in evidence.items():
        client.set_model_version_tag(name, version, key, value)
    if incident is not None:
        record_incident(client, incident, {"incident": incident, "action": f"canary_{action}", "from": version,
                                           "to": canary.champion_version, "reason": why, "requested_by": requested_by,
                                           "requested_at": now_iso(), "status": "completed"}, name)
    return CanaryEnd(version, action, serving.version, why)


def canary_running(cfg: PipelineConfig) -> bool:
    return read_canary(_state_dir(cfg)) is not None


def incident_handled(cfg: PipelineConfig, incident: str) -> bool:
    """Whether `incident` was acted on before (a rollback or a canary's roll-back)."""
    return incident_record(MlflowClient(resolve_tracking_uri(cfg)), incident, cfg.tracking.registered_model) is not None


CANARY_ALERT = "CanaryWorse"


def canary_incident(incident: str) -> bool:
    """Whether an incident is the canary's own alert: the receiver names incidents after their
    alert (`monitoring.receiver.decision.incident_id`)."""
    return incident.startswith(f"{CANARY_ALERT}-")


@task(name="start-canary")
def start_canary_task(cfg: PipelineConfig, version: str) -> Canary:
    """The pipeline's stage: a candidate that passed the gates serves as the canary."""
    return start_canary(cfg, version)
