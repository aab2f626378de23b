"""The reward-model term of the policy's reward: an ensemble's scores shaped against reward hacking.

Pure functions, no engines. The K members of a reward-model ensemble score the same B
responses (raw scores (K, B)); each member is normalised with its own stats, and
`proxy_reward` applies the steps of `RewardShapingConfig` in order:

    normalise   (raw_k - mean_k) / std_k, exactly as `rlhf_core.models.reward.normalise`
    aggregate   mean | min | mean - std_coef * std over the K members (Coste et al. 2023)
    clip        to [-clip, clip]
    bounded     sigmoid((score - reference_score) / scale)                (PAR, Fu et al. 2025)
    length      - coef * relu(length - reference_length), and/or the batch's least-squares
                dependence on length removed

With one member and every option off the result is `normalise(raw[0], stats)` bit for bit,
so `mix_rewards(proxy, ...)` is the reward `combine_rewards` always gave
(`rlhf_core.training.rewards`).

Where this departs from the papers:
- Coste et al.'s uncertainty-weighted objective subtracts lambda * variance; `mean_minus_std`
  subtracts lambda * std, which is in the score's own units, so lambda does not depend on
  the reward's scale.
- PAR compares each response with the reward of reference responses to the same prompt;
  here `reference_score` is one scalar for the batch (the reference policy's mean aggregated
  normalised score), so no extra reference generations are scored per step.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf_core.config import RewardShapingConfig
from rlhf_core.models.reward import RewardStats, normalise

AGGREGATES = ("mean", "min", "mean_minus_std")


def aggregate_ensemble(scores: torch.Tensor, method: str, std_coef: float) -> tuple[torch.Tensor, dict[str, float]]:
    """One score per response from K members' scores. (K, B) -> (B,), metrics.

    mean            the members' mean
    min             the worst member (worst-case optimisation)
    mean_minus_std  mean - std_coef * std, std the population std over members
                    (uncertainty-weighted optimisation)

    Coste et al. 2023, "Reward Model Ensembles Help Mitigate Overoptimization".
    One member (K=1) is returned as it is by every method, bit for bit.
    Metrics: ensemble_disagreement, the mean over responses of the std over members.
    """
    if method not in AGGREGATES:
        raise ValueError(f"unknown ensemble aggregate {method!r}; known: {', '.join(AGGREGATES)}")
    if scores.dim() != 2:
        raise ValueError(f"ensemble scores must be (K, B); got shape {tuple(scores.shape)}")
    if scores.shape[0] == 0:
        raise ValueError("ensemble scores have no members (K=0)")
    if scores.shape[0] == 1:
        return scores[0], {"ensemble_disagreement": 0.0}
    std = scores.std(0, correction=0)  # (B,)
    metrics = {"ensemble_disagreement": std.mean().item()}
    if method == "min":
        return scores.min(0).values, metrics
    mean = scores.mean(0)  # (B,)
    if method == "mean":
        return mean, metrics
    return mean - std_coef * std, metrics


def normalise_members(raw: torch.Tensor, means: Sequence[float], stds: Sequence[float]) -> torch.Tensor:
    """Each member's raw scores standardised by its own stats: (raw_k - mean_k) / std_k. (K, B) -> (K, B)."""
    if raw.dim() != 2:
        raise ValueError(f"raw ensemble scores must be (K, B); got shape {tuple(raw.shape)}")
    if not len(means) == len(stds) == raw.shape[0]:
        raise ValueError(f"{raw.shape[0]} members but {len(means)} means and {len(stds)} stds")
    if any(s <= 0 for s in stds):
        raise ValueError(f"normalisation stds must be > 0; got {list(stds)}")
    # per member through `normalise` itself, so one member is exactly today's reward
    return torch.stack([normalise(member, RewardStats(float(m), float(s))) for member, m, s in zip(raw, means, stds)])


def clip_reward(r: torch.Tensor, bound: float) -> torch.Tensor:
    """r clamped to [-bound, bound]. (B,) -> (B,)."""
    if bound <= 0:
        raise ValueError(f"clip bound must be > 0; got {bound}")
    return r.clamp(-bound, bound)


def bounded_shaping(r: torch.Tensor, reference_score: float, scale: float) -> torch.Tensor:
    """sigmoid((r - reference_score) / scale), in (0, 1). (B,) -> (B,).

    Preference As Reward (PAR), Fu et al. 2025, "Reward Shaping to Mitigate Reward Hacking
    in RLHF": the reward is bounded, is 0.5 at the reference, and its slope vanishes once the
    policy is far past the reference, so pushing the proxy further gains almost nothing.
    (In floating point it saturates to exactly 0 or 1 far from the reference.)
    """
    if scale <= 0:
        raise ValueError(f"bounded shaping scale must be > 0; got {scale}")
    return torch.sigmoid((r - reference_score) / scale)


def length_penalty(r: torch.Tensor, lengths: torch.Tensor, reference_length: float, coef: float) -> torch.Tensor:
    """r - coef * relu(lengths - reference_length): a cost per token beyond the reference length.

    r (B,), lengths (B,) response token counts -> (B,). Responses no longer than the
    reference keep their reward.
    """
    _check_lengths(r, lengths)
    return r - coef * torch.relu(lengths.to(r.device, r.dtype) - reference_length)


def length_decorrelate(r: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """r - beta * (lengths - mean(lengths)), beta = cov(r, lengths) / var(lengths) over the batch.

    r (B,), lengths (B,) -> (B,) in r's dtype. Removes the least-squares linear dependence of
    the reward on length within the batch, so a longer response is not rewarded for its
    length alone; the batch mean is unchanged. Population moments, computed in float64.
    Lengths that are all equal (var 0) leave r unchanged.
    """
    _check_lengths(r, lengths)
    r64, lengths64 = r.double(), lengths.to(r.device, torch.float64)  # (B,), (B,)
    centred = lengths64 - lengths64.mean()
    var = (centred * centred).mean()
    if var == 0:
        return r
    beta = ((r64 - r64.mean()) * centred).mean() / var
    return (r64 - beta * centred).to(r.dtype)


def proxy_reward(
    raw: torch.Tensor,
    means: Sequence[float],
    stds: Sequence[float],
    lengths: torch.Tensor,
    cfg: RewardShapingConfig,
    reference_score: float | None,
    reference_length: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The shaped reward-model term of each response. raw (K, B), lengths (B,) -> (B,), metrics.

    normalise_members -> aggregate_ensemble -> clip_reward (cfg.clip) -> bounded_shaping
    (cfg.bounded; needs reference_score, in aggregated normalised units) -> length_penalty
    (cfg.length_penalty > 0; needs reference_length, in tokens) -> length_decorrelate.
    Metrics: ensemble_disagreement, proxy_score_mean (the aggregated score before clip and
    shaping), shaped_reward_mean (the returned reward).
    """
    if raw.dim() != 2 or lengths.shape != raw.shape[1:]:
        raise ValueError(
            f"raw scores must be (K, B) and lengths (B,); got {tuple(raw.shape)} and {tuple(lengths.shape)}")
    score, metrics = aggregate_ensemble(normalise_members(raw, means, stds), cfg.aggregate, cfg.std_coef)
    metrics["proxy_score_mean"] = score.mean().item()
    if cfg.clip is not None:
        score = clip_reward(score, cfg.clip)
    if cfg.bounded:
        if reference_score is None:
            raise ValueError("policy.shaping.bounded needs reference_score (the reference policy's mean score)")
        score = bounded_shaping(score, reference_score, cfg.bounded_scale)
    if cfg.length_penalty > 0:
        if reference_length is None:
            raise ValueError("policy.shaping.length_penalty > 0 needs reference_length (the reference's mean length)")
        score = length_penalty(score, lengths, reference_length, cfg.length_penalty)
    if cfg.length_decorrelate:
        score = length_decorrelate(score, lengths)
    metrics["shaped_reward_mean"] = score.mean().item()
    return score, metrics


def _check_lengths(r: torch.Tensor, lengths: torch.Tensor) -> None:
    if r.dim() != 1 or lengths.shape != r.shape:
        raise ValueError(f"rewards and lengths must both be (B,); got {tuple(r.shape)} and {tuple(lengths.shape)}")
