"""The trainer's view of rollouts: logprobs of sampled tokens under the Hugging Face model.

Used to check the rollout engine against the trainer (`rollout/logprob_diff`) and to
compute the "old" and reference logprobs of a PPO / GRPO step. No vLLM here; greedy
decoding with the trainer model is `rlhf_core.eval.accuracy.greedy_completions`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf_core.algos.losses import logprobs_from_logits
from rlhf_core.models.logits import logits_from


def right_padded(
    prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate prompt + response per row, right-padded.

    Returns input_ids (B, L) long and attention_mask (B, L) long. Right padding keeps every
    real token at position = its index, so the default position ids are correct; `pad_id` is
    never attended to and may be any valid token id.
    """
    rows = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return input_ids, mask


@torch.no_grad()
def recompute_logprobs(
    model: torch.nn.Module,
    prompt_ids_list: Sequence[Sequence[int]],
    response_ids_list: Sequence[Sequence[int]],
    temperature: float = 1.0,
    batch_size: int = 64,
) -> list[torch.Tensor]:
    """log pi(y_t | x, y_<t) of each response token under `model`, at `temperature`.

    Prompt ids must already start with <s> (as the engine reports them). Returns one float
    tensor (len(response),) per row. Position t of the response is predicted by the logits
    at absolute position len(prompt) + t - 1. This matches vLLM's processed logprobs when
    the rollout used the same temperature and top_p=1.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    was_training = model.training
    model.eval()
    out: list[torch.Tensor] = []
    try:
        for start in range(0, len(prompt_ids_list), batch_size):
            prompts = prompt_ids_list[start : start + batch_size]
            responses = response_ids_list[start : start + batch_size]
            input_ids, mask = right_padded(prompts, responses)
            first = min(len(p) for p in prompts) - 1  # the first column that predicts a response token
            logits, offset = logits_from(model, input_ids, mask, first)  # (B, L - offset, V)
            logp = logprobs_from_logits(logits[:, first - offset : -1] / temperature, input_ids[:, first + 1 :])
            for row, (p, r) in enumerate(zip(prompts, responses)):  # logp[:, t] predicts token first + t + 1
                out.append(logp[row, len(p) - 1 - first : len(p) - 1 - first + len(r)].float())
    finally:
        model.train(was_training)
    return out
