"""The KL of a policy to its reference, per sequence: the figure `policy.kl_bound` bounds.
`sampled_kl` is measured at the end of an offline (DPO, KTO) stage on the held-out prompts, on
the models' device; `exact_kl` at the gates (`rlhf_core.eval.evaluate`)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf_core.algos.losses import logprobs_from_logits
from rlhf_core.algos.preference import sequence_logprobs
from rlhf_core.models.logits import logits_from
from rlhf_core.rollout.hf_reference import right_padded

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


@torch.no_grad()
def exact_kl(model, reference, tokenizer, prompts: Sequence[str], max_new_tokens: int, temperature: float,
             seed: int = 0, batch_size: int = 128) -> float:
    """Mean over `prompts` of sum_t KL(pi_T(.|x,y<t) || ref_T(.|x,y<t)) along one answer y ~ pi_T
    per prompt: the exact per-token KL over the whole vocabulary at the temperature T, summed
    along the answer (an unbiased estimate of the sequence KL with less variance than `sampled_kl`'s
    log-ratio of the sampled tokens alone). Both models read `tokenizer`'s ids and sit on one
    device, where the answers are drawn (on a GPU from its own generator, seeded by `seed` too)."""
    tok = tokenizer
    device = next(model.parameters()).device
    side = tok.padding_side
    tok.padding_side = "left"
    model.eval()
    reference.eval()
    total, count = 0.0, 0
    try:
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            for start in range(0, len(prompts), batch_size):
                enc = tok(list(prompts[start : start + batch_size]), return_tensors="pt", padding=True).to(device)
                gen = model.generate(
                    **enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_p=1.0,
                    top_k=0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                )
                prompt_ids = [row[m.bool()].tolist() for row, m in zip(enc["input_ids"], enc["attention_mask"])]
                responses = [_until_eos(row.tolist(), tok.eos_token_id) for row in gen[:, enc["input_ids"].shape[1] :]]
                total += float(_summed_token_kl(model, reference, prompt_ids, responses, temperature).sum())
                count += len(responses)
    finally:
        tok.padding_side = side
    return total / count


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids



def _summed_token_kl(policy, reference, prompt_ids, response_ids, temperature: float, rows: int = KL_ROWS
                     ) -> torch.Tensor:
    """(B,) sum over response positions of the exact KL between the two next-token
    distributions at `temperature`; positions after a response's end count 0. Runs `rows`
    sequences at a time, each model's head only from the columns that predict responses on."""
    return torch.cat([_rows_token_kl(policy, reference, prompt_ids[i : i + rows], response_ids[i : i + rows],
                                     temperature) for i in range(0, len(prompt_ids), rows)])


def _rows_token_kl(policy, reference, prompt_ids, response_ids, temperature: float) -> torch.Tensor:
    device = next(policy.parameters()).device
    input_ids, mask = (t.to(device) for t in right_padded(prompt_ids, response_ids))  # (B, L)
    first = min(len(p) for p in prompt_ids) - 1  # the first column that predicts a response token
    logits_p, offset_p = logits_from(policy, input_ids, mask, first)
    logits_q, offset_q = logits_from(reference, input_ids, mask, first)
    logp = torch.log_softmax(logits_p[:, first - offset_p :].float() / temperature, -1)  # (B, L - first, V)
    logq = torch.log_softmax(logits_q[:, first - offset_q :].float() / temperature, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)  # (B, L - first): column t predicts position first + t + 1
    predicts_response = torch.zeros_like(kl)
    for row, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        predicts_response[row, len(p) - 1 - first : len(p) - 1 - first + len(r)] = 1.0
    return (kl * predicts_response).sum(-1)
