"""The `evaluate`, `deploy-champion` and `rollback` flows: what operators run by hand (from
the Prefect UI or `rlhf`) and what the alert receiver starts.

- `evaluate` re-runs the gates on a registered `policy` version (default: the challenger)
  against its reference policy and the current champion, and records the verdict on the
  version (tags `gate.*`): a version that now fails is refused by `rlhf promote`.
- `deploy-champion` serves `models:/policy@champion` (blue/green; see `tasks.deploy`).
- `rollback` moves `champion` back for an incident and redeploys; asking again for the same
  incident does nothing.
"""
from __future__ import annotations

from typing import Any

from prefect import flow

from rlhf_core.config import load_config
from rlhf_core.default_config import DEFAULT_CONFIG
from tasks.data import prepare_data
from tasks.deploy import deploy_champion, move_champion_back, record_rollback
from tasks.evaluate import Candidate, eval_set, evaluate_candidate, fetch_version
from tasks.registry import POLICY, get_version
from tasks.tracking import recorded_outcome, run_stage, start_pipeline_run, summary_header

REWARD_MODEL = "reward-model"


@flow(name="evaluate", log_prints=True)
def evaluate_flow(
    candidate: str = "challenger", config_path: str = DEFAULT_CONFIG, overrides: list[str] | None = None
) -> dict[str, Any]:
    """Evaluate a registered policy version against its reference policy and the champion.

    Args:
        candidate: a version number of `policy`, or an alias (`challenger`, `champion`).
        config_path: pipeline config whose eval data and `gates` thresholds apply.
        overrides: `key.path=value` items applied on top of the file.
    """
    cfg = load_config(config_path, overrides)
    run = start_pipeline_run(cfg, config_source=str(config_path), flow_name="evaluate")
    summary = summary_header(run, "evaluate", str(config_path))
    with recorded_outcome(run, summary) as stages:
        client = run.client
        version = get_version(client, candidate)
        tags = version.tags
        base_dir = run.out_dir / "reference"
        if not base_dir.exists():
            client.download_artifacts(tags["base_model.run_id"], "model", str(run.out_dir))
            (run.out_dir / "model").rename(base_dir)
        model = Candidate(
            fetch_version(run.tracking_uri, str(version.version), run.out_dir / "candidate"),
            base_dir,
            fetch_version(run.tracking_uri, tags["reward_model.version"], run.out_dir / "reward", REWARD_MODEL),
            {k: v for k, v in tags.items() if k in ("dataset.fingerprint", "base_model.run_id", "reward_model.version",
                                                      "policy.run_id", "algorithm")} | {"pipeline.run_id": run.run_id},
        )
        prompts, answers = eval_set(prepare_data(cfg, run.out_dir), cfg)
        evaluation = run_stage(stages, "evaluate", evaluate_candidate, model, prompts, answers, cfg, run)
        for key, value in {"gate.passed": str(evaluation.passed).lower(),
                           "gate.reasons": "; ".join(evaluation.decision.reasons),
                           "gate.vs_champion": evaluation.champion_version or "none",
                           "eval.run_id": evaluation.run_id}.items():
            client.set_model_version_tag(POLICY, str(version.version), key, value)
        summary["candidate_version"] = str(version.version)
        if not evaluation.passed:
            summary.update(status="rejected", reasons=list(evaluation.decision.reasons))
    return summary


@flow(name="deploy-champion", log_prints=True)
def deploy_champion_flow(config_path: str = DEFAULT_CONFIG, overrides: list[str] | None = None) -> dict[str, Any]:
    """Serve `models:/policy@champion` with vLLM's OpenAI-compatible server (blue/green).

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
    """Move `champion` back to the previous version (or `to_version`) and serve it.

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
    plan = move_champion_back(cfg, incident, reason, requested_by, to_version)
    deployment = None
    if plan.action != "none" and cfg.serving.enabled:  # serving.enabled false: something else serves the alias
        deployment = deploy_champion(cfg)
    record = record_rollback(cfg, plan, deployment)
    return {"incident": incident, "action": plan.action, "from_version": plan.from_version,
            "to_version": plan.to_version, "serving": None if deployment is None else deployment.summary(),
            "record": record}
