"""The sampled KL of a policy to its reference, per sequence: the figure `policy.kl_bound`
bounds, measured at the end of an offline (DPO, KTO) stage on the held-out prompts, on the
models' device."""
from __future__ import annotations

import torch

from rlhf_core.algos.losses import logprobs_from_logits
from rlhf_core.algos.preference import sequence_logprobs
from rlhf_core.models.logits import logits_from

EVAL_BATCH = 256  # prompts per generate call
KL_ROWS = 16  # sampled answers per forward pass: (16, answer length, vocabulary) logits at a time


@torch.no_grad()
def sampled_kl(model, reference, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float,
               seed: int) -> float:
    """Mean over `prompts` of log π(y|x) − log π_ref(y|x) for one answer y sampled from `model`
    per prompt, both at the sampling `temperature` (the k1 estimate of KL(π || π_ref) per
    sequence, the unit of `policy.kl_bound`)."""
    if not prompts:
        return 0.0
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    total = 0.0
    try:
        for i in range(0, len(prompts), EVAL_BATCH):
            enc = tokenizer(prompts[i : i + EVAL_BATCH], return_tensors="pt", padding=True).to(device)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                                 top_k=0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            width = enc["input_ids"].shape[1]
            generated = out[:, width:]
            # the answer's tokens up to and including the first EOS
            after_eos = torch.cumsum((generated == tokenizer.eos_token_id).long(), dim=1)
            answer = (after_eos == 0) | ((after_eos == 1) & (generated == tokenizer.eos_token_id))
            attention = torch.cat([enc["attention_mask"], answer.long()], dim=1)
            positions = (attention.cumsum(-1) - 1).clamp(min=0)  # as generate numbers left-padded rows
            for j in range(0, out.shape[0], KL_ROWS):  # the head only at the answer's columns, a few rows at a time
                rows = slice(j, j + KL_ROWS)
                diff = []
                for m in (model, reference):
                    logits, offset = logits_from(m, out[rows], attention[rows], width - 1, position_ids=positions[rows])
                    logits = logits[:, width - 1 - offset : -1].float()
                    diff.append(logprobs_from_logits(logits / temperature, generated[rows]))
                    del logits
                total += sequence_logprobs(diff[0] - diff[1], answer[rows]).sum().item()
    finally:
        tokenizer.padding_side = side
    return total / len(prompts)
