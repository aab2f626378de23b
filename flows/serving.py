"""The `deploy-champion` and `rollback` flows: what operators run by hand (from the Prefect UI
or `rlhf`) and what the alert receiver starts. They only move registry aliases and serving
processes, so their imports stay light (no torch, no transformers): an incident's rollback
starts in seconds. The `evaluate` flow, which loads models, is in `flows.evaluate`.

- `deploy-champion` serves `models:/<tracking.registered_model>@champion` (blue/green; see
  `tasks.deploy`).
- `rollback` moves `champion` back for an incident and redeploys, or rolls back the canary
  while one runs (`tasks.canary`); asking again for the same incident does nothing.
"""
from __future__ import annotations

from typing import Any

from prefect import flow

from rlhf_core.config import load_config
from rlhf_core.config.default import DEFAULT_CONFIG
from tasks.canary import canary_incident, canary_running, end_canary, incident_handled
from tasks.deploy import deploy_champion, move_champion_back, record_rollback


@flow(name="deploy-champion", log_prints=True)
def deploy_champion_flow(config_path: str = DEFAULT_CONFIG, overrides: list[str] | None = None) -> dict[str, Any]:
    """Serve the champion of `tracking.registered_model` (default `policy`) with vLLM's
    OpenAI-compatible server (blue/green).

    Args:
        config_path: pipeline config; its `serving` section says where and how to serve.
        overrides: `key.path=value` items applied on top of the file.
    """
    cfg = load_config(config_path, overrides)
    return deploy_champion(cfg).summary()


@flow(name="rollback", log_prints=True)
def rollback_flow(
    incident: str,
    reason: str,
    requested_by: str,
    to_version: str | None = None,
    config_path: str = DEFAULT_CONFIG,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Move `champion` back to the previous version (or `to_version`) and serve it. A canary
    that runs is rolled back first (every user back to the champion); for the canary's own
    alert (`CanaryWorse`) that is all, and the champion stays.

    Args:
        incident: incident id (alert fingerprint, ticket); a second request for the same
            incident does nothing.
        reason: why, recorded on the registry and in the artifact.
        requested_by: who asked (a person, or `alertmanager:<receiver>`).
        to_version: the version to return to; default the one the champion replaced.
        config_path: pipeline config (tracking and serving sections apply).
        overrides: `key.path=value` items applied on top of the file.
    """
    cfg = load_config(config_path, overrides)
    if canary_running(cfg) and not incident_handled(cfg, incident):
        own = canary_incident(incident)
        ended = end_canary(cfg, "roll_back", requested_by, f"incident {incident}: {reason}",
                           incident=incident if own else None)
        if own:
            return {"incident": incident, "action": "canary_rolled_back", "from_version": ended.version,
                    "to_version": ended.serving, "serving": ended.summary(), "record": None}
    plan = move_champion_back(cfg, incident, reason, requested_by, to_version)
    deployment = None
    if plan.action != "none" and cfg.serving.enabled:  # serving.enabled false: something else serves the alias
        deployment = deploy_champion(cfg)
    record = record_rollback(cfg, plan, deployment)
    return {"incident": incident, "action": plan.action, "from_version": plan.from_version,
            "to_version": plan.to_version, "serving": None if deployment is None else deployment.summary(),
            "record": record}
