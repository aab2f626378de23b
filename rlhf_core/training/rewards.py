"""Sequence rewards of policy optimisation: verifiable rewards and their mix with the reward model.

Pure functions, no engines: the reward model's raw scores come in as a tensor (scored by
`rlhf_core.models.reward.score`), are normalised with the reward model's stats, and are
mixed with a verifiable reward by the configured weights:

    reward = reward_model_weight * (rm_score - mean) / std + verifiable_reward_weight * verifiable

Verifiable rewards live in `VERIFIABLE_REWARDS`, name -> fn(prompts, responses) -> (B,) 0/1.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from rlhf_core.algos.masked import Registry
from rlhf_core.models.reward import RewardStats, normalise

VERIFIABLE_REWARDS = Registry("verifiable reward")

_ADDITION = re.compile(r"^\s*(\d+)\+(\d+)=\s*$")


def addition_target(prompt: str) -> str:
    """The demo task's answer to `a+b=`: the sum zero-padded to one more digit than the
    operands (`07+48=` -> `055`, see `rlhf_core.data.synthetic.answer_for`).
    Raises ValueError for a prompt that is not a demo addition."""
    match = _ADDITION.match(prompt)
    if match is None:
        raise ValueError(f"not an addition prompt of the demo task: {prompt!r}")
    a, b = match.groups()
    return f"{int(a) + int(b):0{max(len(a), len(b)) + 1}d}"


@VERIFIABLE_REWARDS.register("addition_exact_match")
def addition_exact_match(prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
    """1.0 where the response (white space stripped) is exactly the padded sum, else 0.0. -> (B,)."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    return torch.tensor(
        [float(r.strip() == addition_target(p)) for p, r in zip(prompts, responses)], dtype=torch.float32
    )


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
    terms = []
    if reward_model_weight:
        if rm_scores is None or rm_stats is None:
            raise ValueError("reward_model_weight > 0 needs reward-model scores and stats")
        terms.append(reward_model_weight * normalise(rm_scores.float(), rm_stats))
    if verifiable_reward_weight:
        if verifiable is None:
            raise ValueError("verifiable_reward_weight > 0 needs verifiable rewards")
        terms.append(verifiable_reward_weight * verifiable.float())
    if not terms:
        raise ValueError("both reward weights are 0: there is no reward")
    return torch.stack(terms).sum(0)
