"""The gates' models, loaded on one device and compared there: what the gate stage runs as a Ray
task with the policy stage's resources (`rlhf_core.distributed.stage_task`): on a GPU where
the cluster has one, else on the CPU. Every model is frozen there as the trainers freeze theirs
(`placement.frozen_on`): bf16 on a GPU, as served on one (a 7B candidate, reference and
champion fit one H100 so); as saved, fp32, on the CPU."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from rlhf_core.config import PipelineConfig
from rlhf_core.eval.evaluate import EvalResult, Policy, Scorer, evaluate, scorers_for
from rlhf_core.eval.gates import gate
from rlhf_core.eval.regression import RegressionSuite
from rlhf_core.models.llama import load_policy
from rlhf_core.models.placement import frozen_on
from rlhf_core.tokenizer import load_tokenizer


@dataclass(frozen=True)
class GateModels:
    """Where the compared models are saved (on storage every node of the cluster reads)."""

    candidate: Path
    reference: Path
    reward: Path
    champion: Path | None = None
    audit: Path | None = None


def evaluate_on(device: torch.device, models: GateModels, prompts: Sequence[str], answers: Sequence[str] | None,
                cfg: PipelineConfig, suites: Sequence[RegressionSuite] = ()) -> EvalResult:
    """`evaluate` of the candidate against the reference and the champion, every model on
    `device`, with the run's gate settings (`cfg.gates`) judging the looks at the eval prompts."""
    def policy(name: str, model_dir: Path) -> Policy:
        return Policy(name, frozen_on(load_policy(model_dir), device), load_tokenizer(model_dir))

    def moved(scorer: Scorer | None) -> Scorer | None:
        if scorer is not None:
            frozen_on(scorer.model, device)
        return scorer

    scorer, audit = scorers_for(models.reward, cfg.reward.max_length, models.audit)
    return evaluate(
        policy("candidate", models.candidate), policy("reference", models.reference),
        None if models.champion is None else policy("champion", models.champion), moved(scorer), prompts, answers,
        max_new_tokens=cfg.policy.max_new_tokens, temperature=cfg.policy.temperature, seed=cfg.policy.seed,
        audit=moved(audit), confidence=cfg.gates.confidence, bootstrap_samples=cfg.gates.bootstrap_samples,
        suites=suites, checker=cfg.data.answer_checker, first_look=cfg.gates.eval_prompts,
        max_prompts=cfg.gates.max_eval_prompts, judge=partial(gate, thresholds=cfg.gates),
    )
