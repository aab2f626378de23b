"""The base-policy stage: tokenizer → tiny Llama (or the pretrained model) → SFT → held-out
accuracy → HF directory.

This is the entry point the Prefect task calls; it knows nothing of Prefect or MLflow.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf_core.config import PipelineConfig
from rlhf_core.eval.accuracy import answer_accuracy, greedy_completions
from rlhf_core.models.llama import build_policy, load_policy, num_parameters, save_pretrained_atomic
from rlhf_core.tokenizer import load_tokenizer, train_tokenizer
from rlhf_core.training.sft import train_sft
from rlhf_core.training.stage_types import MetricsCallback, StageFailed


@dataclass(frozen=True)
class BasePolicyResult:
    path: Path
    num_parameters: int
    vocab_size: int
    sft_steps: int
    sft_final_loss: float
    sft_seconds: float
    eval_accuracy: float | None  # None when there is no verifiable eval set


def make_base_policy(
    sft_prompts: Sequence[str],
    sft_completions: Sequence[str],
    tokenizer_texts: Sequence[str],
    eval_prompts: Sequence[str],
    eval_answers: Sequence[str],
    cfg: PipelineConfig,
    out_dir: Path,
    on_metrics: MetricsCallback | None = None,
    pretrained: Path | None = None,
    device: torch.device | str = "cpu",
) -> BasePolicyResult:
    """SFT from scratch (a tokenizer trained on `tokenizer_texts`, a model built from `cfg.model`),
    or, with `pretrained` (a directory `rlhf_core.models.pretrained.materialise` wrote), of that
    model; trained and evaluated on `device` in fp32, saved from the host."""
    if pretrained is not None:
        tokenizer, model = load_tokenizer(pretrained), load_policy(pretrained)
    else:
        tokenizer = train_tokenizer(tokenizer_texts, cfg.tokenizer.vocab_size)
        model = build_policy(cfg.model, tokenizer, seed=cfg.sft.seed)
    model.to(device)
    sft = train_sft(model, tokenizer, sft_prompts, sft_completions, cfg.sft, on_metrics=on_metrics)
    accuracy = None
    if eval_prompts:
        predictions = greedy_completions(model, tokenizer, eval_prompts, cfg.sft.max_new_tokens)
        accuracy = answer_accuracy(eval_prompts, predictions, eval_answers, cfg.data.answer_checker)
    path = save_pretrained_atomic(model.cpu(), tokenizer, out_dir, extra={"stage": "sft", "eval_accuracy": accuracy})
    result = BasePolicyResult(
        path, num_parameters(model), len(tokenizer), sft.steps, sft.final_loss, sft.seconds, accuracy
    )
    if accuracy is not None and accuracy < cfg.sft.min_eval_accuracy:
        raise StageFailed(f"sft: held-out accuracy {accuracy:.3f} is below sft.min_eval_accuracy={cfg.sft.min_eval_accuracy}")
    return result


def make_base_policy_on(device: torch.device, *args, **kwargs) -> BasePolicyResult:
    """`make_base_policy` on `device`: what the SFT stage runs as a Ray task
    (`rlhf_core.distributed.stage_task`)."""
    return make_base_policy(*args, device=device, **kwargs)
