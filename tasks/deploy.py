"""Prefect tasks that serve the champion and roll it back.

`deploy_champion` serves `models:/policy@champion` with vLLM's OpenAI-compatible server
(`rlhf_core.serving.server.deploy`: blue/green, health check and smoke completion before
the new server takes over; a failed deploy leaves the old one serving). `rollback_champion`
moves `champion` back for an incident (once per incident) and redeploys.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlflow
from mlflow.tracking import MlflowClient
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from rlhf_core.config import PipelineConfig
from rlhf_core.serving import server
from tasks.registry import (
    CHAMPION, POLICY, RegistryError, RollbackPlan, by_alias, complete_rollback, fetch_version, now_iso, start_rollback,
)
from tasks.tracking import resolve_tracking_uri


@dataclass(frozen=True)
class Deployment:
    version: str
    url: str
    served_model_name: str
    sample_prompt: str
    sample_completion: str
    previous_version: str | None  # what served before; None for the first deploy
    changed: bool  # False when the champion was already serving
    seconds: float
    api_key_env: str

    def summary(self) -> dict:
        return {"status": "serving", "version": self.version, "endpoint": self.url,
                "served_model_name": self.served_model_name, "changed": self.changed,
                "previous_version": self.previous_version,
                "sample": f"{self.sample_prompt!r} -> {self.sample_completion!r}", "seconds": round(self.seconds, 1)}


def _publish(d: Deployment, state_dir) -> None:
    create_markdown_artifact(
        key="deployed-endpoint",
        description="The endpoint serving the champion",
        markdown="\n".join([
            f"# Serving `{POLICY}` v{d.version}",
            "",
            "| | |",
            "|---|---|",
            f"| endpoint | `{d.url}/v1` (OpenAI-compatible) |",
            f"| model name | `{d.served_model_name}` |",
            f"| API key | `${d.api_key_env}`, else `{state_dir}/api_key` |",
            f"| replaced | {'v' + d.previous_version if d.previous_version else '–'} |",
            f"| smoke completion | `{d.sample_prompt}` → `{d.sample_completion}` |",
            f"| recorded in | `{state_dir}/current.json` |",
        ]),
    )


@task(name="deploy-champion")
def deploy_champion(cfg: PipelineConfig) -> Deployment:
    """Serve the champion; a no-op (re-checked with a smoke completion) when it already serves."""
    log = get_run_logger()
    uri = resolve_tracking_uri(cfg)
    client = MlflowClient(uri)
    champion = by_alias(client, CHAMPION)
    if champion is None:
        raise RegistryError(f"{POLICY} has no {CHAMPION}: promote a version first (`rlhf promote VERSION`)")
    version = str(champion.version)
    state_dir = server.state_dir_for(cfg.serving, cfg.output_dir)
    key = server.resolve_api_key(cfg.serving, state_dir)
    current = server.current_endpoint(state_dir)
    if current is not None and current.version == version and server.health(current.url):
        text = server.complete(current.url, key, current.served_model_name, cfg.serving.smoke_prompt,
                               cfg.serving.smoke_max_tokens)
        log.info("policy v%s already serves at %s", version, current.url)
        d = Deployment(version, current.url, current.served_model_name, cfg.serving.smoke_prompt, text,
                       current.version, changed=False, seconds=0.0, api_key_env=cfg.serving.api_key_env)
        _publish(d, state_dir)
        return d
    if current is not None and not champion.tags.get("previous_champion") and current.version != version:
        # promoted by hand in the MLflow UI: what served until now is what a rollback returns to
        client.set_model_version_tag(POLICY, version, "previous_champion", current.version)
    model_dir = fetch_version(uri, version, state_dir / "models")
    result = server.deploy(model_dir, version, cfg.serving, state_dir)
    client.set_model_version_tag(POLICY, version, "serving.endpoint", result.endpoint.url)
    client.set_model_version_tag(POLICY, version, "serving.deployed_at", now_iso())
    d = Deployment(version, result.endpoint.url, result.endpoint.served_model_name, cfg.serving.smoke_prompt,
                   result.smoke_completion, None if result.previous is None else result.previous.version,
                   changed=True, seconds=result.seconds, api_key_env=cfg.serving.api_key_env)
    _publish(d, state_dir)
    log.info("policy v%s serves at %s (%.0f s to healthy)", version, d.url, d.seconds)
    return d


@dataclass(frozen=True)
class Rollback:
    plan: RollbackPlan
    deployment: Deployment | None  # None when the incident was handled before

    def summary(self) -> dict:
        p = self.plan
        return {"status": "already handled" if p.action == "none" else "rolled back", "incident": p.incident,
                "from_version": p.from_version, "to_version": p.to_version,
                "serving": None if self.deployment is None else self.deployment.url}


@task(name="move-champion-back")
def move_champion_back(
    cfg: PipelineConfig, incident: str, reason: str, requested_by: str, to_version: str | None
) -> RollbackPlan:
    uri = resolve_tracking_uri(cfg)
    client = MlflowClient(uri)
    plan = start_rollback(client, incident, reason, requested_by, to_version)
    if plan.action == "move":
        mlflow.set_tracking_uri(uri)
        exp = client.get_experiment_by_name(cfg.tracking.experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(cfg.tracking.experiment)
        run = client.create_run(exp_id, run_name=f"rollback-{incident}", tags={
            "pipeline": "rollback", "incident": incident, "rollback.reason": reason,
            "rollback.requested_by": requested_by, "rollback.from": plan.from_version, "rollback.to": plan.to_version,
        })
        client.set_terminated(run.info.run_id, "FINISHED")
    return plan


@task(name="record-rollback")
def record_rollback(cfg: PipelineConfig, plan: RollbackPlan, deployment: Deployment | None) -> dict:
    client = MlflowClient(resolve_tracking_uri(cfg))
    record = plan.record if deployment is None else complete_rollback(client, plan, deployment.version)
    create_markdown_artifact(
        key="rollback",
        description=f"Rollback for incident {plan.incident}",
        markdown="\n".join([
            f"# Rollback for incident `{plan.incident}`",
            "",
            "| | |",
            "|---|---|",
            f"| action | {'nothing (handled before)' if plan.action == 'none' else plan.action} |",
            f"| champion | v{plan.from_version} → v{plan.to_version} |",
            f"| reason | {record.get('reason', '')} |",
            f"| requested by | {record.get('requested_by', '')} |",
            f"| requested at | {record.get('requested_at', '')} |",
            f"| serving | {deployment.url if deployment else '(unchanged)'} |",
        ]),
    )
    return record
