"""Prefect task for the reward-model stage (Ray Train + DeepSpeed), registered as `reward-model`."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlflow.entities import Param
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from monitoring.progress import ProgressSink
from monitoring.sink import MlflowMetricsSink
from rlhf_core.config import PipelineConfig
from rlhf_core.data.pairs import steps_per_epoch
from rlhf_core.distributed.reward_trainer import RewardModels, RewardTrainResult, train_reward_models
from rlhf_core.training.stage_types import StageStopped
from tasks.data import ValidatedData
from tasks.monitoring import exported
from tasks.pretrained import stage_gpu_need
from tasks.registry import register_model_version
from tasks.sft import BasePolicy
from tasks.tracking import PipelineRun, flatten, record_stop, stage_run



@dataclass(frozen=True)
class RewardModel:
    models: RewardModels
    run_id: str  # the stage's MLflow run
    version: str  # registered version of `reward-model`

    @property
    def result(self) -> RewardTrainResult:
        return self.models.proxy

    @property
    def path(self) -> Path:
        return self.result.path

    @property
    def audit_dir(self) -> Path | None:
        """The audit model, saved inside the reward model's directory; None when none was trained."""
        return self.models.audit.path if self.models.audit is not None else None

    def summary(self) -> dict:
        r, audit = self.result, self.models.audit
        out = {"status": "completed", "eval_accuracy": round(r.eval_accuracy, 4), "registered_version": self.version,
               "steps": r.steps, "attempts": r.run.attempts, "seconds": round(r.run.seconds, 1), "model_path": str(r.path)}
        if r.run.resumed_from_step is not None:
            out["resumed_from_step"] = r.run.resumed_from_step
        if len(r.member_eval_accuracy) > 1:
            out["members"] = len(r.member_eval_accuracy)
        if audit is not None:
            out["audit_eval_accuracy"] = round(audit.eval_accuracy, 4)
            out["seconds"] = round(r.run.seconds + audit.run.seconds, 1)
        out["labels"] = self.models.proxy_pairs + self.models.audit_pairs
        return out


def _report(models: RewardModels, version: str) -> str:
    r, audit = models.proxy, models.audit
    lines = [
        f"# Reward model v{version}",
        "",
        "| figure | value |",
        "|---|---|",
        f"| held-out pairwise accuracy | {r.eval_accuracy:.3f} |",
        f"| held-out Bradley-Terry loss | {r.eval_loss:.4f} |",
        f"| reward mean / std (normalisation) | {r.reward_mean:.3f} / {r.reward_std:.3f} |",
        f"| optimizer steps | {r.steps} |",
        f"| pairs truncated to max_length | {r.truncated} |",
        f"| attempts (1 + restarts) | {r.run.attempts} |",
        f"| seconds | {r.run.seconds:.1f} |",
        f"| training pairs (labels) | {models.proxy_pairs} |",
    ]
    if len(r.member_eval_accuracy) > 1:
        lines.append(f"| ensemble members' held-out accuracy | {', '.join(f'{a:.3f}' for a in r.member_eval_accuracy)} |")
    if audit is not None:
        lines.append(f"| audit model: held-out accuracy (its own {models.audit_pairs} pairs) | {audit.eval_accuracy:.3f} |")
    return "\n".join(lines)


@task(name="train-reward-model")
def train_reward_model_task(data: ValidatedData, base: BasePolicy, cfg: PipelineConfig, run: PipelineRun,
                            backbone: Path | None = None) -> RewardModel:
    """The reward model from `backbone` (reward.base_model's directory), else from the base policy."""
    log = get_run_logger()
    backbone = backbone or base.path
    lineage = {"dataset.fingerprint": data.fingerprint, "base_model.run_id": base.run_id,
               "base_model.path": str(backbone), "pipeline.run_id": run.run_id}
    with stage_run(run, "reward", lineage) as stage_id:
        client = run.client
        params = flatten(cfg.reward.model_dump(mode="json"), "reward.")
        params["reward.global_batch_size"] = str(cfg.reward.global_batch_size)
        client.log_batch(stage_id, params=[Param(k, v) for k, v in params.items()])
        train, held_out = data.split
        sink = MlflowMetricsSink(run.tracking_uri, stage_id)
        total = steps_per_epoch(len(train), cfg.reward.global_batch_size) * cfg.reward.epochs
        figures = {"reward/loss": "loss", "reward/accuracy": "accuracy"}
        try:
            with ProgressSink("reward", total, figures) as progress, \
                    exported(cfg, stage_id, "reward", sink, progress=progress) as on_metrics:
                models = train_reward_models(
                    train, held_out, backbone, cfg.reward,
                    run.site("reward", on_metrics, stage_id, gpu_need=stage_gpu_need("reward", cfg, backbone)))
        except StageStopped as exc:
            record_stop(client, stage_id, exc)
            raise
        result = models.proxy
        audit_figures = {} if models.audit is None else {
            "reward_audit/eval_accuracy": models.audit.eval_accuracy, "reward_audit/seconds": models.audit.run.seconds}
        member_figures = {f"reward/eval_accuracy/member_{k}": a for k, a in enumerate(result.member_eval_accuracy)}
        sink(result.steps, audit_figures | member_figures | {
            "reward/labels": models.proxy_pairs + models.audit_pairs,
            "reward/eval_accuracy": result.eval_accuracy, "reward/eval_loss": result.eval_loss,
            "reward/norm_mean": result.reward_mean, "reward/norm_std": result.reward_std,
            "reward/truncated_pairs": result.truncated, "reward/attempts": result.run.attempts,
            "reward/seconds": result.run.seconds,
        })
        client.log_artifacts(stage_id, str(result.path), artifact_path="model")
        name = cfg.tracking.registered_reward_model
        version = register_model_version(
            client, name, stage_id, "model",
            tags={**lineage, "eval_accuracy": f"{result.eval_accuracy:.4f}"},
            description=f"Bradley-Terry reward model, held-out pairwise accuracy {result.eval_accuracy:.3f}",
        )
        client.set_tag(stage_id, "registered_model", f"{name}/{version}")
        client.set_tag(run.run_id, "reward_model.version", version)
        create_markdown_artifact(key="reward-model-metrics", markdown=_report(models, version),
                                 description="Reward-model training")
        log.info("reward model v%s: held-out accuracy %.3f", version, result.eval_accuracy)
    return RewardModel(models, stage_id, version)
