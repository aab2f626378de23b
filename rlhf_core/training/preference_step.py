"""The per-batch math of the offline policy methods (DPO, IPO, KTO): the log-probabilities of
two sequences per row under the policy and its reference, and the method's loss on them. The
distributed driver (`rlhf_core.distributed.offline_trainer`) runs it in its epoch loop, as
`rlhf_core.training.policy_step` is run for PPO and GRPO.

Both methods score two sequences per row (`TokenizedPairs`): for DPO the chosen and the
rejected answer; for KTO the labelled answer and, to the same prompt, another example's answer
(`rlhf_core.data.pairs.with_mismatched`), on which each micro-batch estimates KTO's reference
point, the policy's KL to the reference (Ethayarajh et al. 2024, section 4.1).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rlhf_core.algos.losses import logprobs_from_logits
from rlhf_core.algos.preference import dpo_loss, kto_loss, kto_reference_point, sequence_logprobs
from rlhf_core.config import PolicyConfig
from rlhf_core.data.pairs import TokenizedPairs, collate_pairs, response_mask
from rlhf_core.distributed import collectives
from rlhf_core.models.logits import logits_from
from rlhf_core.models.lora import reference_view


@dataclass(frozen=True)
class Rows:
    """A data set as the workers read it: two sequences per row, and for KTO each row's label."""

    pairs: TokenizedPairs
    desirable: np.ndarray | None  # (N,) bool for KTO; None for DPO

    def __len__(self) -> int:
        return len(self.pairs)


def pair_logprobs(model: torch.nn.Module, pairs: TokenizedPairs, indices: Sequence[int], average: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(response | prompt) of the chosen and the rejected response of the pairs at
    `indices` under `model` (summed over response tokens, or averaged with `average`) ->
    ((B,), (B,)). Runs one forward pass over the 2B sequences; gradients flow when enabled."""
    batch = collate_pairs(pairs, indices)
    device = next(model.parameters()).device
    ids = batch.input_ids.to(device)
    first = int(min(pairs.prompt_lengths[i] for i in indices)) - 1  # the first column that predicts a response token
    logits, offset = logits_from(model, ids, batch.attention_mask.to(device), first)  # the head from `first` on
    token_logprobs = logprobs_from_logits(logits[:, first - offset : -1].float(), ids[:, first + 1 :])  # (2B, L-1-first)
    mask = response_mask(pairs, indices, ids.shape[1]).to(device)[:, first:]
    seq = sequence_logprobs(token_logprobs, mask, average)
    return seq[: batch.num_pairs], seq[batch.num_pairs :]


# per method, the loss's figures a step reports (as policy/<name>), averaged over micro-batches and ranks
FIGURES = {
    "dpo": ("loss", "reward_accuracy", "reward_margin", "reward_chosen", "reward_rejected", "logp_chosen",
            "logp_rejected"),
    "kto": ("loss", "reward_desirable", "reward_undesirable", "reference_point", "desirable_share"),
}


def chunked_pair_logprobs(model: torch.nn.Module, pairs: TokenizedPairs, indices: Sequence[int], average: bool,
                          chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`pair_logprobs` over `indices`, `chunk` pairs a forward pass (None: one pass): the same
    values, with the logits of one chunk held at a time."""
    if chunk is None or len(indices) <= chunk:
        return pair_logprobs(model, pairs, indices, average)
    parts = [pair_logprobs(model, pairs, indices[i : i + chunk], average) for i in range(0, len(indices), chunk)]
    return torch.cat([c for c, _ in parts]), torch.cat([r for _, r in parts])


def offline_loss(policy, reference, rows: Rows, indices: Sequence[int], cfg: PolicyConfig, world: int = 1,
                 chunk: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The method's loss on the rows at `indices`: reference log-probs without gradients (from
    `reference`, or with None from `policy` with its LoRA adapters off), the policy's with
    them; forward passes of `chunk` rows (None: all at once). For KTO the reference point is
    averaged over the `world` ranks (a collective when world > 1: every rank must call it as
    often)."""
    if cfg.algorithm == "dpo":
        d = cfg.dpo
        average = d.loss_type == "ipo"
        with torch.no_grad(), reference_view(policy, reference) as ref:
            ref_chosen, ref_rejected = chunked_pair_logprobs(ref, rows.pairs, indices, average, chunk)
        chosen, rejected = chunked_pair_logprobs(policy, rows.pairs, indices, average, chunk)
        return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, d.beta, d.loss_type, d.label_smoothing)
    k = cfg.kto
    with torch.no_grad(), reference_view(policy, reference) as ref:
        ref_own, ref_mismatched = chunked_pair_logprobs(ref, rows.pairs, indices, False, chunk)
    own, mismatched = chunked_pair_logprobs(policy, rows.pairs, indices, False, chunk)
    z = kto_reference_point(mismatched, ref_mismatched)
    if world > 1:
        collectives.all_reduce(z, what="KTO's reference point")
        z = z / world
    desirable = torch.from_numpy(rows.desirable[np.asarray(indices, dtype=np.int64)]).to(own.device)
    return kto_loss(own, ref_own, desirable, z, k.beta, k.desirable_weight, k.undesirable_weight)
