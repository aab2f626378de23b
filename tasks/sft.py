"""Prefect task for the SFT base-policy stage.

SFT is deterministic in its inputs and the most expensive CPU stage of the demo, so its
result is cached: a run whose data (the dataset fingerprint and the SFT corpus's), `sft`,
`model` and `tokenizer` settings and MLflow store are those of an earlier run reuses that
run's base policy (and its MLflow run, so lineage tags still point at the run that trained
it). Change any input and it is trained again. The flow retrains when the cached model
directory no longer exists (`runs/` cleaned).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from mlflow.entities import Param
from prefect import get_run_logger, task

from monitoring.progress import ProgressSink
from monitoring.prometheus import FanOut
from monitoring.sink import MlflowMetricsSink
from rlhf_core.config import PipelineConfig
from rlhf_core.data.schema import fingerprint, read_table
from rlhf_core.distributed.stage_task import run_stage_task
from rlhf_core.training.base_policy import BasePolicyResult, make_base_policy_on
from tasks.data import ValidatedData
from tasks.monitoring import exported
from tasks.pretrained import PretrainedBase
from tasks.tracking import PipelineRun, flatten, stage_run


# Bump when the SFT code changes what it produces for the same inputs.
SFT_CACHE_VERSION = 2  # 2: the demo tokenizer carries its chat template


@dataclass(frozen=True)
class BasePolicy:
    result: BasePolicyResult
    run_id: str  # the stage's MLflow run
    pipeline_run_id: str = ""  # the pipeline run that trained it (another one's when cached)
    skipped: bool = False  # sft.enabled is false: the pretrained model as it is

    @property
    def path(self) -> Path:
        return self.result.path

    def summary(self) -> dict:
        r = self.result
        if self.skipped:
            return {"status": "skipped", "reason": "sft.enabled is false", "num_parameters": r.num_parameters,
                    "model_path": str(r.path)}
        return {"status": "completed", "trained_by_run": self.pipeline_run_id, "eval_accuracy": r.eval_accuracy, "num_parameters": r.num_parameters,
                "seconds": round(r.sft_seconds, 1), "model_path": str(r.path)}


def _now_and_then(log, every: int = 250):
    """Tell the flow's log how training goes, now and then (in this process: the exporter hands
    it the steps the SFT task reports)."""

    def on_metrics(step: int, metrics: dict[str, float]) -> None:
        if step % every == 0:
            log.info("sft step %d: loss %.4f, %.0f tokens/s", step, metrics["sft/loss"], metrics["sft/tokens_per_s"])

    return on_metrics


def sft_cache_key(context, parameters: dict) -> str:
    """Everything the base policy depends on (see the module docstring)."""
    data, cfg, run = parameters["data"], parameters["cfg"], parameters["run"]
    inputs = {
        "version": SFT_CACHE_VERSION,
        "data": data.fingerprint,
        "sft_corpus": fingerprint(data.paths.sft) if data.paths.sft is not None else None,
        "settings": {k: getattr(cfg, k).model_dump(mode="json") for k in ("sft", "model", "tokenizer")},
        "pretrained": _files_stamp(parameters.get("pretrained")),
        "tracking_uri": run.tracking_uri,
    }
    return "sft-" + hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def _files_stamp(pretrained: PretrainedBase | None) -> list | None:
    """Name, size and modification time of the pretrained files: a changed model is trained again."""
    if pretrained is None:
        return None
    files = sorted(p for p in pretrained.policy.iterdir() if p.is_file())
    return [(p.name, p.stat().st_size, p.resolve().stat().st_mtime_ns) for p in files]


@task(name="use-pretrained-base")
def use_pretrained_base(pretrained: PretrainedBase, cfg: PipelineConfig, run: PipelineRun) -> BasePolicy:
    """sft.enabled is false: the pretrained model is the base policy; the stage records that."""
    with stage_run(run, "sft", {"model.pretrained": str(cfg.model.pretrained)}) as stage_id:
        run.client.set_tag(stage_id, "sft.skipped", "true")
        run.client.set_tag(stage_id, "model.path", str(pretrained.policy))
    info = pretrained.info
    result = BasePolicyResult(pretrained.policy, info.num_parameters, info.vocab_size, 0, float("nan"), 0.0, None)
    return BasePolicy(result, stage_id, run.run_id, skipped=True)


@task(name="train-base-policy", cache_key_fn=sft_cache_key, persist_result=True, cache_expiration=timedelta(days=30))
def train_base_policy(data: ValidatedData, cfg: PipelineConfig, run: PipelineRun,
                      pretrained: PretrainedBase | None = None) -> BasePolicy:
    log = get_run_logger()
    with stage_run(run, "sft", {"dataset.fingerprint": data.fingerprint}) as stage_id:
        client = run.client
        prefs = read_table(data.paths.preferences)
        if data.paths.sft is not None:
            sft = read_table(data.paths.sft)
            prompts, completions = list(sft["prompt"]), list(sft["completion"])
        else:  # no SFT corpus: imitate the preferred responses
            prompts, completions = list(prefs["prompt"]), list(prefs["chosen"])
        evals = read_table(data.paths.eval) if data.paths.eval is not None else None
        if evals is not None and "answer" not in evals.columns:
            evals = None  # no answers: no held-out accuracy
        texts = [p + c for p, c in zip(prompts, completions)] + list(prefs["prompt"] + prefs["chosen"]) + list(
            prefs["prompt"] + prefs["rejected"]
        )
        for section in ("sft", "model", "tokenizer"):
            params = flatten(getattr(cfg, section).model_dump(mode="json"), f"{section}.")
            client.log_batch(stage_id, params=[Param(k, v) for k, v in params.items()])
        total = math.ceil(len(prompts) / cfg.sft.batch_size) * cfg.sft.epochs  # as the SFT loop counts steps
        sink = MlflowMetricsSink(run.tracking_uri, stage_id)
        # one Ray task with the policy stage's resources: on a GPU where the cluster has one
        with ProgressSink("sft", total, {"sft/loss": "loss"}) as progress, \
                exported(cfg, stage_id, "sft", sink, progress=FanOut(progress, _now_and_then(log))) as on_metrics:
            result, where = run_stage_task(
                "sft", make_base_policy_on,
                prompts,
                completions,
                texts,
                list(evals["prompt"]) if evals is not None else [],
                list(evals["answer"]) if evals is not None else [],
                cfg,
                run.out_dir / "models" / "sft",
                on_metrics=on_metrics,
                pretrained=pretrained.policy if pretrained is not None else None,
                use_gpu=cfg.policy.use_gpu, settings="policy",
            )
        client.set_tag(stage_id, "sft.device", where)
        client.log_metric(stage_id, "sft/num_parameters", result.num_parameters)
        client.log_metric(stage_id, "sft/seconds", result.sft_seconds)
        if result.eval_accuracy is not None:
            client.log_metric(stage_id, "sft/eval_accuracy", result.eval_accuracy)
        client.log_artifacts(stage_id, str(result.path), artifact_path="model")
        client.set_tag(stage_id, "model.path", str(result.path))
        log.info("base policy: %d parameters, held-out accuracy %s", result.num_parameters, result.eval_accuracy)
    return BasePolicy(result, stage_id, run.run_id)
