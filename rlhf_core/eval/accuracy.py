"""Held-out accuracy for tasks with a verifiable answer: the exact answer text, or a checker
(`data.answer_checker`) that finds the answer in a sentence."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerFast

from rlhf_core.training.verifiable import check_answers


@torch.no_grad()
def greedy_completions(
    model, tokenizer: PreTrainedTokenizerFast, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 256
) -> list[str]:
    """Greedy decoding with Hugging Face `generate`, left-padded batches, stopped at `</s>`, on
    the model's device."""
    model.eval()
    device = next(model.parameters()).device
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    out: list[str] = []
    try:
        for i in range(0, len(prompts), batch_size):
            enc = tokenizer(list(prompts[i : i + batch_size]), return_tensors="pt", padding=True).to(device)
            gen = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            out += tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
    return out


def answer_accuracy(prompts: Sequence[str], predictions: Sequence[str], answers: Sequence[str],
                    checker: str | None = None) -> float:
    """Share of rows `rlhf_core.training.verifiable.check_answers` accepts."""
    if not answers:
        raise ValueError("no answers to score")
    right = check_answers(prompts, predictions, answers, checker)
    return sum(right) / len(right)
