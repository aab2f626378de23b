"""Prefect task for the policy-optimisation stage: PPO or GRPO on Ray Train + DeepSpeed with
rollouts from vLLM, or DPO / IPO on the preference pairs (`policy.algorithm: dpo`). The final
policy is logged to the stage's MLflow run; registering it as a `policy` version is the
gates' decision (a later stage), not this one's."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlflow.entities import Param
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from monitoring.progress import ProgressSink
from monitoring.sink import MlflowMetricsSink
from rlhf_core.config import PipelineConfig
from rlhf_core.data.pairs import kto_examples, steps_per_epoch
from rlhf_core.data.schema import read_table
from rlhf_core.distributed.offline_trainer import train_offline
from rlhf_core.distributed.policy_trainer import PolicyTrainResult, train_policy
from rlhf_core.training.circuit_breaker import CircuitBreakerTripped
from rlhf_core.training.stage_types import StageStopped
from tasks.data import ValidatedData
from tasks.monitoring import exported
from tasks.pretrained import stage_gpu_need
from tasks.reward import RewardModel
from tasks.sft import BasePolicy
from tasks.tracking import PipelineRun, flatten, record_stop, stage_run


@dataclass(frozen=True)
class TrainedPolicy:
    result: PolicyTrainResult
    run_id: str  # the stage's MLflow run

    @property
    def path(self) -> Path:
        return self.result.path

    def summary(self) -> dict:
        r = self.result
        return {
            "status": "completed", "algorithm": r.algorithm,
            "accuracy_before": r.accuracy_before, "accuracy_after": r.accuracy_after,
            "rm_score_before": _round(r.rm_score_before), "rm_score_after": _round(r.rm_score_after),
            **({"audit_score_before": _round(r.audit_score_before), "audit_score_after": _round(r.audit_score_after)}
               if r.audit_score_before is not None else {}),
            **({"labels_asked": r.labels_asked, "round_pairs": r.round_pairs} if r.labels_asked else {}),
            "kl_max": round(r.kl_max, 3), "kl_bound": r.kl_bound, "steps": r.steps,
            "nonfinite_skipped": r.nonfinite_skipped, "attempts": r.run.attempts,
            **({"resumed_from_step": r.run.resumed_from_step} if r.run.resumed_from_step is not None else {}),
            "seconds": round(r.run.seconds, 1), "model_path": str(r.path),
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def training_prompts(data: ValidatedData) -> list[str]:
    """The prompt set (`data.prompts_path`), else the distinct prompts of the SFT corpus and the
    preference data, in first-seen order."""
    if data.paths.prompts is not None:
        return list(dict.fromkeys(read_table(data.paths.prompts)["prompt"]))
    prompts = [r["prompt"] for r in data.pairs]
    if data.paths.sft is not None:
        prompts = list(read_table(data.paths.sft)["prompt"]) + prompts
    return list(dict.fromkeys(prompts))


def prompt_answers(data: ValidatedData) -> dict[str, str]:
    """prompt -> answer of the prompt set, when it has an `answer` column (for verifiable rewards
    that check against it)."""
    if data.paths.prompts is None:
        return {}
    table = read_table(data.paths.prompts)
    if "answer" not in table.columns:
        return {}
    return {p: str(a) for p, a in zip(table["prompt"], table["answer"]) if a is not None and a == a}


def _report(r: PolicyTrainResult) -> str:
    rows = [
        ("algorithm", r.algorithm),
        ("held-out accuracy before → after", f"{_round(r.accuracy_before)} → {_round(r.accuracy_after)}"),
        ("reward-model score before → after", f"{_round(r.rm_score_before)} → {_round(r.rm_score_after)}"),
        ("KL to reference, max / final (bound)", f"{r.kl_max:.3f} / {r.kl_final:.3f} ({r.kl_bound})"),
        ("iterations", r.steps),
        ("non-finite steps skipped", r.nonfinite_skipped),
        ("attempts (1 + restarts)", r.run.attempts),
        ("seconds", f"{r.run.seconds:.1f}"),
    ]
    return "\n".join([f"# Policy ({r.algorithm})", "", "| figure | value |", "|---|---|"]
                     + [f"| {k} | {v} |" for k, v in rows])


@task(name="optimise-policy")
def optimise_policy(
    data: ValidatedData, base: BasePolicy, reward: RewardModel, cfg: PipelineConfig, run: PipelineRun
) -> TrainedPolicy:
    log = get_run_logger()
    lineage = {"dataset.fingerprint": data.fingerprint, "base_model.run_id": base.run_id,
               "reward_model.version": reward.version, "reward_model.run_id": reward.run_id,
               "pipeline.run_id": run.run_id}
    with stage_run(run, "policy", lineage) as stage_id:
        client = run.client
        params = flatten(cfg.policy.model_dump(mode="json"), "policy.")
        client.log_batch(stage_id, params=[Param(k, v) for k, v in params.items()])
        prompts, answers = data.eval_set
        sink = MlflowMetricsSink(run.tracking_uri, stage_id)
        try:
            if cfg.policy.offline is not None:  # dpo, kto: no rollouts, no reward model in training
                result = _train_offline(data, base, cfg, run, stage_id, sink, prompts, answers)
            else:
                figures = {"policy/reward_mean": "reward", "policy/kl": "KL"}
                with ProgressSink("policy", cfg.policy.steps, figures) as progress, \
                        exported(cfg, stage_id, "policy", sink, kl_bound=cfg.policy.kl_bound, progress=progress) as on_metrics:
                    result = train_policy(
                        training_prompts(data),
                        prompts,
                        answers or [],
                        base.path,
                        reward.path,
                        cfg.policy,
                        run.site("policy", on_metrics, stage_id,
                                 gpu_need=stage_gpu_need("policy", cfg, base.path, reward.path)),
                        answers=prompt_answers(data),
                        replay_pairs=data.pairs,
                        validation=cfg.validation,
                        answer_checker=cfg.data.answer_checker,
                    )
        except CircuitBreakerTripped as exc:
            for key, value in {"circuit_breaker.reason": exc.trip.reason, "circuit_breaker.step": exc.trip.step,
                               "circuit_breaker.checkpoint": exc.checkpoint_path or "none"}.items():
                client.set_tag(stage_id, key, str(value))
            log.error("%s", exc)
            raise
        except StageStopped as exc:
            record_stop(client, stage_id, exc)
            raise
        sink(result.steps, {  # headline figures; None (no reward model) is not logged
            "policy/accuracy_before": result.accuracy_before, "policy/accuracy_after": result.accuracy_after,
            "policy/accuracy_gain": result.accuracy_gain, "policy/kl_max": result.kl_max,
            "policy/rm_score_before": result.rm_score_before, "policy/rm_score_after": result.rm_score_after,
            "policy/nonfinite_skipped_total": result.nonfinite_skipped, "policy/attempts": result.run.attempts,
            "policy/seconds": result.run.seconds,
            "policy/audit_score_before": result.audit_score_before, "policy/audit_score_after": result.audit_score_after,
            "policy/labels_asked": result.labels_asked, "policy/round_pairs": result.round_pairs,
        })
        sink(result.steps, {f"policy/peak_rss_gib/{phase}": v for phase, v in result.peak_memory.items()})
        if cfg.policy.offline is not None:  # the loss's figures on the held-out pairs
            held_out = {k: v for k, v in result.evaluations[-1].items() if k != "step"}
            sink(result.steps, {f"policy/held_out_{k.removeprefix('eval/')}": v for k, v in held_out.items()})
        client.log_artifacts(stage_id, str(result.path), artifact_path="model")
        client.set_tag(stage_id, "checkpoint.path", str(result.run.checkpoint_path))
        create_markdown_artifact(key="policy-metrics", markdown=_report(result), description="Policy optimisation")
        log.info("%s: held-out accuracy %s -> %s, reward-model score %s -> %s", result.algorithm,
                 _round(result.accuracy_before), _round(result.accuracy_after),
                 _round(result.rm_score_before), _round(result.rm_score_after))
    return TrainedPolicy(result, stage_id)


def _train_offline(data: ValidatedData, base: BasePolicy, cfg: PipelineConfig, run: PipelineRun, stage_id: str,
                   sink: MlflowMetricsSink, prompts: list[str], answers: list[str] | None) -> PolicyTrainResult:
    """DPO / IPO / KTO on the pairs the reward model trains on (KTO unpairs them): the prompts
    it holds out (which the gates may judge on) stay out of the policy's training too."""
    train, held_out = data.split
    if cfg.policy.algorithm == "kto" and data.paths.labelled is not None:  # and the feedback's thumbs
        rated = read_table(data.paths.labelled).to_dict("records")
        pairs = len(train)
        train = kto_examples(train, rated, {r["prompt"] for r in held_out}, cfg.policy.kto.desirable_share,
                             cfg.policy.seed)
        run.client.set_tag(stage_id, "kto.feedback_answers", str(len(train) - pairs))
        get_run_logger().info("KTO on %d pairs, one answer each, and %d answers rated in the feedback",
                              pairs, len(train) - pairs)
    total = steps_per_epoch(len(train), cfg.policy.offline.batch_size) * cfg.policy.offline.epochs
    second = {"dpo": ("policy/reward_accuracy", "pair accuracy"), "kto": ("policy/reference_point", "KL estimate")}
    figures = dict([("policy/loss", "loss"), second[cfg.policy.algorithm]])
    with ProgressSink("policy", total, figures) as progress, \
            exported(cfg, stage_id, "policy", sink, kl_bound=cfg.policy.kl_bound, progress=progress) as on_metrics:
        return train_offline(train, held_out, prompts, answers or [], base.path, cfg.policy,
                             run.site("policy", on_metrics, stage_id, gpu_need=stage_gpu_need("policy", cfg, base.path)),
                             answer_checker=cfg.data.answer_checker)
