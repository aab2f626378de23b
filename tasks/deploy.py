"""Prefect tasks that serve the champion and roll it back.

`deploy_champion` serves `models:/<tracking.registered_model>@champion` with vLLM's OpenAI-compatible server
(`rlhf_core.serving.server.deploy`: blue/green, health check and smoke completion before
the new server takes over; a failed deploy leaves the old one serving). `rollback_champion`
moves `champion` back for an incident (once per incident) and redeploys. `serving_plan` is
what `rlhf serving ensure` does when nothing serves.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import mlflow
from mlflow.tracking import MlflowClient
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from rlhf_core.config import PipelineConfig
from rlhf_core.serving import server
from tasks.registry import (
    CHAMPION, RegistryError, RollbackPlan, by_alias, complete_rollback, fetch_version, now_iso, start_rollback,
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
    chat: bool = False  # the model has a chat template: the sample was asked through /v1/chat/completions

    def summary(self) -> dict:
        return {"status": "serving", "version": self.version, "endpoint": self.url,
                "served_model_name": self.served_model_name, "changed": self.changed,
                "previous_version": self.previous_version, "chat": self.chat,
                "sample": f"{self.sample_prompt!r} -> {self.sample_completion!r}", "seconds": round(self.seconds, 1)}


def _publish(d: Deployment, state_dir, name: str) -> None:
    create_markdown_artifact(
        key="deployed-endpoint",
        description="The endpoint serving the champion",
        markdown="\n".join([
            f"# Serving `{name}` v{d.version}",
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


@dataclass(frozen=True)
class ServingPlan:
    action: str  # "none" (a server answers), "deploy" (serve the champion), "demo" (train one first)
    message: str


def serving_plan(serving: str | None, champion: str | None) -> ServingPlan:
    """What `rlhf serving ensure` does, from the version a healthy server serves (None: none does)
    and the registry's champion (None: there is none). Pure, for the table-driven test.

    Something that serves is left alone (`rlhf serving status` tells whether it is the champion);
    a champion that does not serve is deployed; only with no champion is a new one trained.
    """
    if serving is not None:
        return ServingPlan("none", f"policy v{serving} serves")
    if champion is not None:
        return ServingPlan("deploy", f"nothing serves; deploying the champion, policy v{champion}")
    return ServingPlan("demo", "nothing serves and there is no champion: running the demo to train one")


# A deploy that finds the champion moved while it served the old one serves the new one; a
# champion that keeps moving (people promoting in a loop) is reported rather than chased.
MAX_CHAMPION_MOVES = 3


@task(name="deploy-champion")
def deploy_champion(cfg: PipelineConfig) -> Deployment:
    """Serve the champion; a no-op (re-checked with a smoke completion) when it already serves.

    Two deploys may run at once (a scheduled run and a manual one): they take turns on the
    serving state's lock, and each checks after its turn that what it served is still the
    champion, else serves the new one, so that the registry and what serves agree at the end.
    """
    log = get_run_logger()
    client, name = MlflowClient(resolve_tracking_uri(cfg)), cfg.tracking.registered_model
    served = []
    for _ in range(MAX_CHAMPION_MOVES + 1):
        champion = by_alias(client, CHAMPION, name)
        if champion is None:
            raise RegistryError(f"{name} has no {CHAMPION}: promote a version first (`rlhf promote VERSION`)")
        if served and served[-1].version == str(champion.version):
            first, last = served[0], served[-1]
            return last if len(served) == 1 else replace(last, changed=any(d.changed for d in served),
                                                          previous_version=first.previous_version)
        if served:
            log.warning("the champion moved to v%s while v%s was being deployed: serving v%s",
                        champion.version, served[-1].version, champion.version)
        served.append(_serve(client, champion, cfg, log))
    raise server.ServingError(f"the champion moved {MAX_CHAMPION_MOVES} times during one deploy "
                              f"(served in turn: {', '.join('v' + d.version for d in served)}); run `rlhf deploy` again "
                              "once promotions have settled")


def _serve(client: MlflowClient, champion, cfg: PipelineConfig, log) -> Deployment:
    """Serve `champion` (a version of `tracking.registered_model`), or check that it already serves."""
    version, name = str(champion.version), cfg.tracking.registered_model
    state_dir = server.state_dir_for(cfg.serving, cfg.output_dir)
    key = server.resolve_api_key(cfg.serving, state_dir)
    current = server.current_endpoint(state_dir)
    if current is not None and current.version == version and server.health(current.url):
        text = server.smoke(current, key, cfg.serving)
        log.info("%s v%s already serves at %s", name, version, current.url)
        d = Deployment(version, current.url, current.served_model_name, cfg.serving.smoke_prompt, text,
                       current.version, changed=False, seconds=0.0, api_key_env=cfg.serving.api_key_env,
                       chat=server.has_chat_template(current.model_dir))
        _publish(d, state_dir, name)
        return d
    if current is not None and not champion.tags.get("previous_champion") and current.version != version:
        # promoted by hand in the MLflow UI: what served until now is what a rollback returns to
        client.set_model_version_tag(name, version, "previous_champion", current.version)
    model_dir = fetch_version(client.tracking_uri, version, state_dir / "models", name)
    result = server.deploy(model_dir, version, cfg.serving, state_dir, served_model_name=f"{name}-v{version}")
    client.set_model_version_tag(name, version, "serving.endpoint", result.endpoint.url)
    client.set_model_version_tag(name, version, "serving.deployed_at", now_iso())
    d = Deployment(version, result.endpoint.url, result.endpoint.served_model_name, cfg.serving.smoke_prompt,
                   result.smoke_completion, None if result.previous is None else result.previous.version,
                   changed=True, seconds=result.seconds, api_key_env=cfg.serving.api_key_env,
                   chat=server.has_chat_template(result.endpoint.model_dir))
    _publish(d, state_dir, name)
    log.info("%s v%s serves at %s (%.0f s to healthy)", name, version, d.url, d.seconds)
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
    plan = start_rollback(client, incident, reason, requested_by, to_version, name=cfg.tracking.registered_model)
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
    record = plan.record if deployment is None else complete_rollback(
        client, plan, deployment.version, name=cfg.tracking.registered_model)
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
