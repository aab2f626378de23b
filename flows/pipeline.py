"""The `rlhf-pipeline` flow: (pretrained model) → validate → SFT base policy (or the pretrained
model as it is) → reward model → PPO | GRPO (or DPO | KTO) → evaluation gates → registry → deployment.

The flow only composes tasks. Every run writes `summary.json` (stage verdicts and headline
figures) into its output directory, so that schedulers and scripts can read the outcome
without parsing logs. Its `status` is one of:

- `completed`: the candidate passed the gates and is registered as `policy` (alias
  `challenger`; with `gates.auto_promote` also `champion`, and then it serves, or with
  `serving.canary.enabled` and a champion serving, it serves a share of the users as a canary);
- `rejected`: the candidate failed a gate; it is not registered, `reasons` say why, and
  what serves is unchanged. The MLflow run is FINISHED with tag `gate.passed=false`;
- `undecided`: no gate failed, but the evaluation cannot tell the candidate from a bar (a
  candidate as good as the champion): it is registered with no alias (tag
  `gate.status=undecided`) and nothing serves it; `reasons` say which calls are open and how
  many eval prompts would decide them, `next_steps` the commands that look at more rows or
  promote it past the gates;
- `failed`: a stage raised; `failed_stage` and `error` say which and why.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from prefect import flow

from rlhf_core.config import load_config
from rlhf_core.config.default import DEFAULT_CONFIG
from tasks.cluster import training_cluster
from tasks.data import prepare_data, validate_data
from tasks.canary import start_canary_task
from tasks.deploy import deploy_champion
from tasks.evaluate import Candidate, canary_first, evaluate_candidate, register_candidate, undecided_next_steps
from tasks.policy import optimise_policy
from tasks.pretrained import prepare_pretrained
from tasks.reward import train_reward_model_task
from tasks.sft import train_base_policy, use_pretrained_base
from tasks.run_start import recorded_config, start_pipeline_run
from tasks.summary import record_stage, recorded_outcome, summary_header


@flow(name="rlhf-pipeline", log_prints=True)
def rlhf_pipeline(config_path: str = DEFAULT_CONFIG, overrides: list[str] | None = None,
                  resume: str | None = None) -> dict[str, Any]:
    """Run the RLHF pipeline on the config at `config_path`.

    Args:
        config_path: pipeline config (YAML); the default is the packaged `configs/demo.yaml`.
        overrides: `key.path=value` items applied on top of the file, e.g. `sft.epochs=2`.
        resume: MLflow run id of a failed or killed pipeline run to continue: its completed
            stages are reused, with the config it started with (the config given here only
            says which MLflow store holds it).
    """
    cfg = load_config(config_path, overrides)
    if resume:
        cfg = recorded_config(cfg, resume)
    run = start_pipeline_run(cfg, config_source=str(config_path), resume=resume or None)
    summary = summary_header(run, "rlhf-pipeline", str(config_path))
    with recorded_outcome(run, summary) as stages:
        pretrained = None  # the demo builds its own model
        if cfg.model.pretrained is not None:
            pretrained = record_stage(stages, "pretrained", prepare_pretrained, cfg, run.out_dir)
        paths = record_stage(stages, "data", prepare_data, cfg, run.out_dir, pretrained)  # format, rendering, lengths
        data = record_stage(stages, "validate", validate_data, paths, cfg, run)  # the data contract
        # one Ray cluster for SFT, the training stages and the gates; none when an earlier attempt completed them
        on_ray = (train_reward_model_task, optimise_policy, evaluate_candidate)
        with nullcontext() if all(stages.completed(t.name) is not None for t in on_ray) else training_cluster():
            if cfg.sft.enabled:
                base = record_stage(stages, "sft", train_base_policy, data, cfg, run, pretrained)
                if not base.path.is_dir():  # cached, but its files are gone: train it again
                    base = record_stage(stages, "sft", train_base_policy.with_options(refresh_cache=True), data, cfg,
                                        run, pretrained)
                if base.pipeline_run_id != run.run_id:
                    stages["sft"]["status"] = "cached"
            else:
                base = record_stage(stages, "sft", use_pretrained_base, pretrained, cfg, run)
            backbone = pretrained.reward if pretrained is not None and cfg.reward.base_model else None
            reward = record_stage(stages, "reward", train_reward_model_task, data, base, cfg, run, backbone)
            policy = record_stage(stages, "policy", optimise_policy, data, base, reward, cfg, run)
            candidate = Candidate(policy.path, base.path, reward.path, policy.result.audit_dir or reward.audit_dir, {
                "dataset.fingerprint": data.fingerprint, "base_model.run_id": base.run_id,
                "reward_model.version": reward.version, "policy.run_id": policy.run_id,
                "algorithm": policy.result.algorithm, "pipeline.run_id": run.run_id, **data.paths.lineage(),
            })
            prompts, answers = data.eval_set  # the reward model's held-out prompts without an eval file
            evaluation = record_stage(stages, "evaluate", evaluate_candidate, candidate, prompts, answers, cfg, run)
        d = evaluation.decision
        if d.status == "rejected":
            summary.update(status=d.status, reasons=list(d.reasons))
            return summary
        registration = record_stage(stages, "register", register_candidate, evaluation, cfg, run)
        if d.status == "undecided":
            named = None if config_path == DEFAULT_CONFIG else config_path
            summary.update(status=d.status, reasons=list(d.undecided),
                           next_steps=undecided_next_steps(evaluation, registration.version, named))
            return summary
        if registration.promoted and cfg.serving.enabled:
            record_stage(stages, "deploy", deploy_champion, cfg)
        elif canary_first(cfg, evaluation.champion_version):
            record_stage(stages, "canary", start_canary_task, cfg, registration.version)
    return summary
