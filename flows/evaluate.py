"""The `evaluate` flow: re-run the gates on a registered `policy` version (default: the
challenger) against its reference policy and the current champion, and record the verdict on
the version (tags `gate.*`): a version that now fails is refused by `rlhf promote`.

It lives apart from the deploy and rollback flows because its tasks load the models (torch,
transformers), which an incident's rollback should not wait for.
"""
from __future__ import annotations

from typing import Any

from prefect import flow

from rlhf_core.config import load_config
from rlhf_core.config.default import DEFAULT_CONFIG
from tasks.cluster import training_cluster
from tasks.data import PreparedData, prepare_data
from tasks.evaluate import evaluate_candidate, fetch_registered_candidate, record_gate_verdict
from tasks.pretrained import prepare_pretrained
from tasks.run_start import start_pipeline_run
from tasks.summary import record_stage, recorded_outcome, summary_header


@flow(name="evaluate", log_prints=True)
def evaluate_flow(
    candidate: str = "challenger", config_path: str = DEFAULT_CONFIG, overrides: list[str] | None = None
) -> dict[str, Any]:
    """Evaluate a registered policy version against its reference policy and the champion.

    Args:
        candidate: a version number of `tracking.registered_model` (default `policy`), or an alias
            (`challenger`, `champion`).
        config_path: pipeline config whose eval data and `gates` thresholds apply.
        overrides: `key.path=value` items applied on top of the file.
    """
    cfg = load_config(config_path, overrides)
    run = start_pipeline_run(cfg, config_source=str(config_path), flow_name="evaluate")
    summary = summary_header(run, "evaluate", str(config_path))
    with recorded_outcome(run, summary) as stages:
        registered = fetch_registered_candidate(candidate, cfg, run)
        pretrained = prepare_pretrained(cfg, run.out_dir) if cfg.model.pretrained is not None else None
        prompts, answers = PreparedData.of(prepare_data(cfg, run.out_dir, pretrained), cfg).eval_set  # rendered as in training
        with training_cluster():  # the gates run as Ray work, on a GPU where the cluster has one
            evaluation = record_stage(stages, "evaluate", evaluate_candidate, registered.candidate, prompts, answers,
                                      cfg, run)
        record_gate_verdict(registered.version, evaluation, cfg, run)
        summary["candidate_version"] = registered.version
        if not evaluation.passed:
            d = evaluation.decision
            summary.update(status=d.status, reasons=[*d.reasons, *d.undecided])
    return summary
