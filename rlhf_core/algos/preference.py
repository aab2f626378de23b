"""Offline preference losses: DPO and its IPO variant on pairs, KTO on unpaired labels.

They are fed sequence log-probabilities: log π(y|x) summed over the response tokens
(`sequence_logprobs`), or averaged over them (`average=True`, what IPO is usually run with),
under the policy being trained and under the frozen reference policy. B is the number of
pairs (DPO, IPO) or of labelled examples (KTO). Every loss returns `(scalar loss to minimise,
metrics: dict[str, float])`, metric names without a stage prefix, as in `losses`.

The implicit reward of a response is β·(log π(y|x) − log π_ref(y|x)): the reward under which
the trained policy is optimal for the KL-regularised objective (Rafailov et al. 2023, §4).
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from rlhf_core.algos.masked import masked_mean, masked_sum

DPO_LOSS_TYPES = ("sigmoid", "ipo")


def sequence_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """log π(y|x) of each sequence from its per-token log-probabilities.

    token_logprobs: (B, T), mask: (B, T) 1 on response tokens -> (B,). The sum over the masked
    tokens; with `average` their mean (a sequence with no response token gives 0)."""
    if average:
        return masked_mean(token_logprobs, mask, dim=-1)
    return masked_sum(token_logprobs, mask, dim=-1)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Direct preference optimisation on B pairs; every argument (B,) sequence log-probs.

    With h = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l)), the log-ratio margin:

        "sigmoid"  DPO (Rafailov et al. 2023, eq. 7):  −log σ(β h); with label smoothing ε
                   (conservative DPO, labels flipped with probability ε):
                   −(1 − ε) log σ(β h) − ε log σ(−β h)
        "ipo"      IPO (Azar et al. 2023, eq. 17):      (h − 1/(2β))², which stops pushing once
                   the margin reaches 1/(2β) instead of driving it to infinity

    The loss is the mean over the pairs. Metrics: the loss, the implicit rewards'
    accuracy (chosen above rejected), margin and means, and the policy's log-probs.
    At π = π_ref (h = 0) DPO gives log 2 and IPO 1/(4β²).
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; valid: {', '.join(DPO_LOSS_TYPES)}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        per_pair = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    else:
        per_pair = (h - 1 / (2 * beta)) ** 2
    loss = per_pair.mean()
    reward_chosen, reward_rejected = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    metrics = {
        "loss": loss.item(),
        "reward_accuracy": (reward_chosen > reward_rejected).float().mean().item(),
        "reward_margin": (reward_chosen - reward_rejected).mean().item(),
        "reward_chosen": reward_chosen.mean().item(),
        "reward_rejected": reward_rejected.mean().item(),
        "logp_chosen": policy_chosen.detach().mean().item(),
        "logp_rejected": policy_rejected.detach().mean().item(),
    }
    return loss, metrics


def kto_reference_point(policy_mismatched: torch.Tensor, ref_mismatched: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z_0: an estimate of KL(π || π_ref), clamped at 0 and detached.

    Ethayarajh et al. 2024 (§4.1) estimate it on mismatched pairs: each prompt x_i of the batch
    with another example's response y_j, so that it measures how far the policy has moved in
    general rather than on the labelled answers. Arguments: (M,) sequence log-probs of the
    mismatched pairs under the policy and the reference -> scalar. Under data parallelism
    average the returned value over ranks (the paper's and TRL's batch-level estimate)."""
    return (policy_mismatched - ref_mismatched).mean().clamp(min=0).detach()


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    reference_point: torch.Tensor | float,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Kahneman-Tversky optimisation (Ethayarajh et al. 2024, eq. 8) on B unpaired examples.

    policy_logps, ref_logps: (B,) sequence log-probs of each example's response; desirable:
    (B,) bool, the label (thumbs up); reference_point: z_0 (`kto_reference_point`). With
    r = log π(y|x) − log π_ref(y|x):

        desirable     λ_D (1 − σ(β (r − z_0)))
        undesirable   λ_U (1 − σ(β (z_0 − r)))

    averaged over the B examples. At π = π_ref with z_0 = 0 every example costs λ/2.
    Metrics: the loss, the implicit rewards β·r of each kind (nan when the batch has none of
    that kind) and the reference point.
    """
    desirable = desirable.bool()
    r = policy_logps - ref_logps
    z = torch.as_tensor(reference_point, dtype=r.dtype, device=r.device)
    per_example = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (r - z))),
        undesirable_weight * (1 - torch.sigmoid(beta * (z - r))),
    )
    loss = per_example.mean()
    reward = beta * r.detach()
    nan = float("nan")
    metrics = {
        "loss": loss.item(),
        "reward_desirable": reward[desirable].mean().item() if desirable.any() else nan,
        "reward_undesirable": reward[~desirable].mean().item() if (~desirable).any() else nan,
        "reference_point": float(z),
        "desirable_share": desirable.float().mean().item(),
    }
    return loss, metrics
