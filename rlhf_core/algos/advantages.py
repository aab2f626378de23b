"""Advantage estimators: GAE for PPO with a critic, group-relative advantages for GRPO.

Shapes: B sequences, T response tokens. Masks are 0/1 over response tokens.

All estimators run under `torch.no_grad()`: advantages and returns are targets, never
differentiated through.

Departures from the papers, on purpose:
- `gae` treats the valid tokens of a row as the trajectory and skips masked positions
  (verl's multi-turn variant). With right padding this is exactly CleanRL's loop; with holes
  in the mask (e.g. tool output inside a response) the recursion jumps over them.
- `grpo_advantages` gives a group of size 1 advantage 0 (it has no baseline), where verl
  uses mean 0 / std 1, i.e. the raw score.
- Advantage whitening is not done inside any estimator; call `whiten` where it is wanted.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from rlhf_core.algos.masked import masked_sum
from rlhf_core.algos.masked import masked_whiten as whiten
from rlhf_core.algos.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "gae",
    "grpo_advantages",
    "register_advantage",
    "whiten",
]


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation over token-level rewards.

    rewards, values, mask: (B, T) -> advantages, returns: (B, T).

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t              (the value-function target)

    where t+1 is the next *valid* token of the row; after the last valid token V = 0 and
    A = 0 (the response has ended; nothing to bootstrap). Masked positions are ignored
    (their rewards and values may hold anything) and get advantage 0 and return 0.

    Source: Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE"; the
    backwards `lastgaelam` loop of CleanRL `ppo.py`, vectorised over the batch as in verl
    `compute_gae_advantage_return`.
    """
    mask = mask.bool()
    rewards = torch.where(mask, rewards, 0.0)
    values = torch.where(mask, values, 0.0)
    B, T = rewards.shape
    next_value = rewards.new_zeros(B)  # V of the next valid token, (B,)
    lastgaelam = rewards.new_zeros(B)  # A of the next valid token, (B,)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(T)):
        valid = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * lastgaelam
        advantages[:, t] = torch.where(valid, adv_t, 0.0)
        lastgaelam = torch.where(valid, adv_t, lastgaelam)
        next_value = torch.where(valid, values[:, t], next_value)
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


def _dense_group_index(
    group_ids: torch.Tensor | Sequence[Hashable] | None, group_size: int | None, batch: int, device
) -> torch.Tensor:
    """Group ids (any hashables) or a fixed group size -> dense group index 0..G-1, shape (B,)."""
    if (group_ids is None) == (group_size is None):
        raise ValueError("pass exactly one of group_ids or group_size")
    if group_size is not None:
        if group_size < 1 or batch % group_size:
            raise ValueError(f"batch of {batch} cannot be split into groups of {group_size}")
        return torch.arange(batch, device=device) // group_size
    if not isinstance(group_ids, torch.Tensor):
        first_seen: dict[Hashable, int] = {}
        group_ids = torch.tensor([first_seen.setdefault(g, len(first_seen)) for g in group_ids])
    if group_ids.shape != (batch,):
        raise ValueError(f"group_ids must have shape ({batch},), got {tuple(group_ids.shape)}")
    return torch.unique(group_ids.to(device), return_inverse=True)[1]


@torch.no_grad()
def grpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Hashable] | None = None,
    group_size: int | None = None,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages: each response's score against its group's mean.

    scores: (B,) one scalar per response; group_ids: (B,) the prompt each response answers
    (any hashables), or group_size: consecutive blocks of that size are groups. -> (B,).

        A_i = (s_i - mean_g(s)) / (std_g(s) + eps)     scale_by_std=True  (GRPO)
        A_i =  s_i - mean_g(s)                          scale_by_std=False (Dr. GRPO)

    std is the unbiased group std (torch.std, as verl and TRL). Scores are shifted by their
    group's minimum before averaging, which changes nothing mathematically but makes a group
    of equal scores give exactly 0 (the mean of exact zeros is exactly zero). A group of one
    response has no baseline and gets 0.

    Source: Shao et al. 2024, "DeepSeekMath" (GRPO, outcome supervision); Liu et al. 2025,
    "Understanding R1-Zero-Like Training" (Dr. GRPO, no std scaling); verl
    `compute_grpo_outcome_advantage`.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must have shape (B,), got {tuple(scores.shape)}")
    index = _dense_group_index(group_ids, group_size, scores.shape[0], scores.device)  # (B,)
    G = int(index.max()) + 1 if index.numel() else 0
    zeros = scores.new_zeros(G)
    count = zeros.index_add(0, index, torch.ones_like(scores))  # (G,)
    group_min = zeros.scatter_reduce(0, index, scores, reduce="amin", include_self=False)
    shifted = scores - group_min[index]
    mean = zeros.index_add(0, index, shifted) / count  # (G,)
    centered = shifted - mean[index]  # (B,)
    if not scale_by_std:
        return centered
    var = zeros.index_add(0, index, centered**2) / (count - 1).clamp(min=1)
    return centered / (var.sqrt()[index] + eps)


# The registry gives the trainer one calling convention for every estimator:
#     advantages, returns = ADVANTAGE_ESTIMATORS[name](token_rewards, mask, values=..., group_ids=...,
#                                                      gamma=..., lam=...)
# with token_rewards, mask, values: (B, T); group_ids: (B,). Arguments an estimator does not
# use are ignored. Outcome estimators score a response by the sum of its token rewards and
# broadcast the advantage to its valid tokens; their "returns" equal the advantages (there is
# no critic to fit), as in verl.
ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
register_advantage = ADVANTAGE_ESTIMATORS.register


@register_advantage("gae")
def _gae_estimator(token_rewards, mask, *, values=None, group_ids=None, gamma=1.0, lam=1.0):
    if values is None:
        raise ValueError("the gae estimator needs values from a critic")
    return gae(token_rewards, values, mask, gamma=gamma, lam=lam)


def _outcome_estimator(token_rewards, mask, group_ids, scale_by_std):
    if group_ids is None:
        raise ValueError("group-relative estimators need group_ids")
    with torch.no_grad():
        scores = masked_sum(token_rewards, mask, dim=-1)  # (B,)
        advantages = grpo_advantages(scores, group_ids, scale_by_std=scale_by_std)
        advantages = torch.where(mask.bool(), advantages[:, None], 0.0)  # (B, T)
    return advantages, advantages


@register_advantage("grpo")
def _grpo_estimator(token_rewards, mask, *, values=None, group_ids=None, gamma=1.0, lam=1.0):
    return _outcome_estimator(token_rewards, mask, group_ids, scale_by_std=True)


@register_advantage("grpo_no_std")
def _grpo_no_std_estimator(token_rewards, mask, *, values=None, group_ids=None, gamma=1.0, lam=1.0):
    return _outcome_estimator(token_rewards, mask, group_ids, scale_by_std=False)
