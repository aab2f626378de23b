"""Sequence rewards of policy optimisation: the reward model's and the verifiable reward's mix.

Pure functions, no engines: the reward model's raw scores come in as a tensor (scored by
`rlhf_core.models.reward.score`), are normalised with the reward model's stats, and are
mixed with a verifiable reward by the configured weights:

    reward = reward_model_weight * (rm_score - mean) / std + verifiable_reward_weight * verifiable

The verifiable reward is named by `policy.verifiable_reward` (`rlhf_core.training.verifiable`).
"""
from __future__ import annotations

import torch

from rlhf_core.models.reward import RewardStats, normalise


def combine_rewards(
    rm_scores: torch.Tensor | None,
    rm_stats: RewardStats | None,
    verifiable: torch.Tensor | None,
    reward_model_weight: float,
    verifiable_reward_weight: float,
) -> torch.Tensor:
    """The sequence reward (B,) = weight_rm * normalise(rm_scores) + weight_v * verifiable.

    A term whose weight is 0 may be None (it was never computed); a term with a weight > 0
    must be given.
    """
    if reward_model_weight and (rm_scores is None or rm_stats is None):
        raise ValueError("reward_model_weight > 0 needs reward-model scores and stats")
    rm_reward = normalise(rm_scores.float(), rm_stats) if reward_model_weight else None
    return mix_rewards(rm_reward, verifiable, reward_model_weight, verifiable_reward_weight)


def mix_rewards(
    rm_reward: torch.Tensor | None,
    verifiable: torch.Tensor | None,
    reward_model_weight: float,
    verifiable_reward_weight: float,
) -> torch.Tensor:
    """The sequence reward (B,) = weight_rm * rm_reward + weight_v * verifiable, where
    `rm_reward` is the reward-model term already normalised (and shaped:
    `rlhf_core.training.reward_shaping.proxy_reward`). A term whose weight is 0 may be None."""
    terms = []
    if reward_model_weight:
        if rm_reward is None:
            raise ValueError("reward_model_weight > 0 needs the reward-model term")
        terms.append(reward_model_weight * rm_reward.float())
    if verifiable_reward_weight:
        if verifiable is None:
            raise ValueError("verifiable_reward_weight > 0 needs verifiable rewards")
        terms.append(verifiable_reward_weight * verifiable.float())
    if not terms:
        raise ValueError("both reward weights are 0: there is no reward")
    return torch.stack(terms).sum(0)
