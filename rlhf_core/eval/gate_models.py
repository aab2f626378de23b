"""The gates' models, loaded on one device and compared there: what the gate stage runs as a Ray
task with the policy stage's resources (`rlhf_core.distributed.stage_task`): on a GPU where
the cluster has one, else on the CPU. The policies' answers come from an engine of the kind
serving runs, one at a time (`rlhf_core.eval.served`). The models that score the answers and
measure KL are frozen there as the trainers freeze theirs (`placement.frozen_on`): bf16 on a
GPU (a 7B candidate, reference and champion fit one H100 so); as saved, fp32, on the CPU."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from rlhf_core.config import PipelineConfig
from rlhf_core.eval.evaluate import EvalResult, Policy, Scorer, evaluate, look_budget, scorers_for
from rlhf_core.eval.gates import gate
from rlhf_core.eval.regression import RegressionSuite
from rlhf_core.eval.served import EngineOpener, ServedAnswers
from rlhf_core.models.llama import load_policy
from rlhf_core.models.placement import frozen_on
from rlhf_core.models.pretrained import inspect_pretrained
from rlhf_core.rollout.factory import engine_context, open_serving_engine
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
                cfg: PipelineConfig, suites: Sequence[RegressionSuite] = (),
                open_engine: EngineOpener | None = None) -> EvalResult:
    """`evaluate` of the candidate against the reference and the champion on `device`, with the
    run's gate settings (`cfg.gates`) judging the looks at the eval prompts. The policies answer
    from engines `open_engine` opens (default: serving's kind, `open_serving_engine`), each one's
    first looks before any model loads; on a GPU every look's prompts then, so that no engine
    ever shares the GPU with the models (generating them is cheap there; on a CPU it is not)."""
    opener = open_engine or partial(_serving_engine, serving=cfg.serving, device=device)
    dirs = {"candidate": models.candidate, "reference": models.reference, "champion": models.champion}
    tiers = answer_tiers(prompts, suites, cfg)
    if device.type == "cuda":  # the whole budget before the models load: no engine shares the GPU with them
        tiers = (tiers[0] + tiers[1], ())
    served = {name: served_answers(model_dir, tiers, opener, cfg) for name, model_dir in dirs.items() if model_dir}
    for policy_answers in served.values():
        policy_answers.answer(tiers[0], cfg.policy.max_new_tokens)

    def policy(name: str) -> Policy | None:
        model_dir = dirs[name]
        if model_dir is None:
            return None
        return Policy(name, frozen_on(load_policy(model_dir), device), load_tokenizer(model_dir), served[name])

    def moved(scorer: Scorer | None) -> Scorer | None:
        if scorer is not None:
            frozen_on(scorer.model, device)
        return scorer

    scorer, audit = scorers_for(models.reward, cfg.reward.max_length, models.audit)
    return evaluate(
        policy("candidate"), policy("reference"), policy("champion"), moved(scorer), prompts, answers,
        max_new_tokens=cfg.policy.max_new_tokens, temperature=cfg.policy.temperature, seed=cfg.policy.seed,
        audit=moved(audit), confidence=cfg.gates.confidence, bootstrap_samples=cfg.gates.bootstrap_samples,
        suites=suites, checker=cfg.data.answer_checker, first_look=cfg.gates.eval_prompts,
        max_prompts=cfg.gates.max_eval_prompts, judge=partial(gate, thresholds=cfg.gates),
    )


def answer_tiers(prompts: Sequence[str], suites: Sequence[RegressionSuite], cfg: PipelineConfig
                 ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the prompts of every first look: the eval prompts' and each suite's, the rest of what
    later looks may ask: none without `gates.confidence`, which alone looks again)."""
    first, budget = look_budget(len(prompts), cfg.gates.eval_prompts, cfg.gates.max_eval_prompts)
    looks_again = cfg.gates.confidence is not None
    first_tier = [*prompts[:first], *(p for suite in suites for p in suite.prompts[:suite.first_look])]
    later = [*prompts[first:budget], *(p for suite in suites
                                       for p in suite.prompts[suite.first_look:suite.max_rows or len(suite.prompts)])]
    return tuple(first_tier), tuple(later if looks_again else ())


def served_answers(model_dir: Path, tiers: tuple[tuple[str, ...], ...], open_engine: EngineOpener,
                   cfg: PipelineConfig) -> ServedAnswers:
    """The answers of the policy saved in `model_dir` to `tiers`' prompts, from engines of a
    context that holds the longest of them and its answer (`factory.engine_context`)."""
    asked = [p for tier in tiers for p in tier]
    lengths = [len(ids) for ids in load_tokenizer(model_dir)(asked)["input_ids"]] if asked else []
    model_context = cfg.serving.max_model_len or inspect_pretrained(model_dir).context_length
    if model_context is None:
        raise ValueError(f"{model_dir}/config.json gives no max_position_embeddings; set serving.max_model_len")
    context = engine_context(lengths, cfg.policy.max_new_tokens, model_context)
    return ServedAnswers(model_dir, open_engine, cfg.policy.max_new_tokens, context, tiers)


def _serving_engine(model_dir: Path, max_num_seqs: int, max_model_len: int, *, serving, device: torch.device):
    return open_serving_engine(model_dir, serving, device, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
