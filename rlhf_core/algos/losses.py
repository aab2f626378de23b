"""Losses of RLHF: PPO / GRPO clipped policy surrogate, clipped value loss, Bradley-Terry
reward-model loss; and the log-probability / entropy helpers they are fed from.

Shapes: B sequences, T response tokens, V vocabulary. Every loss returns
`(scalar loss to minimise, metrics: dict[str, float])`; metric names carry no stage prefix
(the training loop adds e.g. "ppo/").

Aggregation (`agg`, verl's `loss_agg_mode`) turns per-token losses L (B, T) into a scalar:

    "token-mean"           sum_{b,t} m L / N_tokens              every token weighs the same
    "seq-mean-token-mean"  sum_b [ sum_t m L / n_b ] / N_seqs    every sequence weighs the same
    "seq-mean-token-sum"   sum_b [ sum_t m L ] / N_seqs          longer sequences weigh more

Micro-batching: by default N_tokens / N_seqs are counted on the batch passed in, so the mean
of micro-batch losses is not the full-batch loss when micro-batches hold different numbers of
tokens. Pass `normalizer=loss_normalizer(full_batch_mask, agg)` (the full batch's count) to
every micro-batch call and *sum* the micro-batch losses (plain gradient accumulation without
dividing by the number of micro-batches): the accumulated gradient is then exactly the
full-batch gradient. Under data parallelism, DDP averages gradients over ranks, so pass the
global count divided by the world size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_core.algos.kl import KL_ESTIMATORS
from rlhf_core.algos.masked import masked_mean, masked_sum, masked_var
from rlhf_core.algos.registry import Registry

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def loss_normalizer(mask: torch.Tensor, agg: str = "token-mean") -> float:
    """The denominator `agg` uses for this mask: number of valid tokens for "token-mean",
    number of sequences otherwise. mask: (B, T) -> float."""
    if agg == "token-mean":
        return float(mask.bool().sum())
    if agg in AGG_MODES:
        return float(mask.shape[0])
    raise ValueError(f"unknown agg {agg!r}; valid: {', '.join(AGG_MODES)}")


def aggregate_loss(
    per_token: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean", normalizer: float | None = None
) -> torch.Tensor:
    """Reduce a per-token loss (B, T) to a scalar with `agg` (see the module docstring).

    normalizer replaces the token count ("token-mean") or the sequence count ("seq-mean-*");
    None means the counts of this batch. A sequence with no valid token contributes 0.
    """
    if normalizer is None:
        normalizer = loss_normalizer(mask, agg)
    if agg == "token-mean":
        total = masked_sum(per_token, mask)
    elif agg == "seq-mean-token-mean":
        total = masked_mean(per_token, mask, dim=-1).sum()
    elif agg == "seq-mean-token-sum":
        total = masked_sum(per_token, mask, dim=-1).sum()
    else:
        raise ValueError(f"unknown agg {agg!r}; valid: {', '.join(AGG_MODES)}")
    return total / max(normalizer, 1.0)


def _clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float,
    clip_range_high: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token PPO-clip loss (B, T) and its diagnostics (token means over valid tokens)."""
    mask = mask.bool()
    # Padding may hold anything (even inf); select it away before exp so neither the loss
    # nor the gradient of a masked token can be NaN.
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)
    advantages = torch.where(mask, advantages, 0.0)
    ratio = torch.exp(log_ratio)
    high = clip_range if clip_range_high is None else clip_range_high
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), mask).item(),
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
        }
    return per_token, metrics


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float = 0.2,
    agg: str = "token-mean",
    normalizer: float | None = None,
    clip_range_high: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate, negated to be minimised.

    logprobs (current policy, with grad), old_logprobs (rollout policy), advantages, mask:
    (B, T) -> (loss (), metrics).

        ratio = exp(logprobs - old_logprobs)
        L_t   = max(-A_t * ratio, -A_t * clip(ratio, 1 - clip_range, 1 + clip_range_high))

    aggregated with `agg` (default "token-mean", as verl and CleanRL). clip_range_high
    defaults to clip_range; a larger value is DAPO's "clip-higher".

    is_weights (B, T), optional: per-token importance weights w_t = pi_old / mu (truncated,
    see `truncated_is_weights`) for samples drawn from a behaviour policy mu that lags the
    "old" (proximal) policy; L_t becomes w_t * L_t. This is the decoupled PPO objective
    (Hilton et al. 2022, "Batch size-invariance for policy optimization", eq. 4; AReaL): the
    clip keeps the update near the proximal policy, the weight corrects for the lag.
    metrics: clipfrac = share of valid tokens where the clipped term is active (their
    gradient is 0; verl's pg_clipfrac, not CleanRL's |ratio - 1| > eps), approx_kl = k3 mean
    of KL(old || new) (CleanRL), ratio_mean.

    Source: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7;
    CleanRL `ppo.py`; verl `compute_policy_loss`.
    """
    per_token, metrics = _clipped_surrogate(
        logprobs, old_logprobs, advantages, mask, clip_range, clip_range_high
    )
    return aggregate_loss(_weighted(per_token, is_weights, mask), mask, agg, normalizer), metrics


def grpo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float = 0.2,
    agg: str = "seq-mean-token-mean",
    normalizer: float | None = None,
    clip_range_high: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO objective: the PPO clipped surrogate plus a per-token KL penalty to the reference
    inside the aggregation, sequence-mean by default.

    Shapes as `ppo_policy_loss`; ref_logprobs: (B, T), needed when kl_coef > 0.

        L_t = ppo_clip_loss_t + kl_coef * k3(logprobs_t, ref_logprobs_t)

    With kl_coef = 0 this is exactly `ppo_policy_loss` with agg="seq-mean-token-mean"
    (DeepSeekMath eq. 3: 1/G sum_i 1/|o_i| sum_t). Pass agg="token-mean" for DAPO's
    token-level loss. The KL here is the loss-side penalty; do not also put it in the reward.
    Extra metric: "kl_loss" (token mean of the KL estimate; 0 when kl_coef is 0).
    is_weights weigh the whole per-token loss, the KL penalty included: the tokens were drawn
    from the lagging sampler, and k3 of a token it liked but the policy no longer does
    (exp(log ref - log pi), unbounded) would otherwise dominate the gradient.

    Source: Shao et al. 2024, "DeepSeekMath", eq. 3-4; verl `kl_loss` with `low_var_kl`.
    """
    per_token, metrics = _clipped_surrogate(
        logprobs, old_logprobs, advantages, mask, clip_range, clip_range_high
    )
    metrics["kl_loss"] = 0.0
    if kl_coef:
        if ref_logprobs is None:
            raise ValueError("grpo_policy_loss with kl_coef > 0 needs ref_logprobs")
        valid = mask.bool()
        kl = KL_ESTIMATORS[kl_estimator](
            torch.where(valid, logprobs, 0.0), torch.where(valid, ref_logprobs, 0.0)
        )
        per_token = per_token + kl_coef * kl
        metrics["kl_loss"] = masked_mean(_weighted(kl.detach(), is_weights, mask), valid).item()
    return aggregate_loss(_weighted(per_token, is_weights, mask), mask, agg, normalizer), metrics


def _weighted(per_token: torch.Tensor, is_weights: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """per_token * is_weights (constants: no gradient; padding, whatever it holds, weighs 0)."""
    if is_weights is None:
        return per_token
    return per_token * torch.where(mask.bool(), is_weights.detach(), 0.0)


def truncated_is_weights(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token importance weights min(pi_old / mu, cap) for tokens sampled from mu.

    old_logprobs: the trainer's logprobs before the update (the proximal policy);
    behaviour_logprobs: the sampler's logprobs of the same tokens; mask (B, T). Truncation at
    `cap` bounds the variance (IMPALA's rho-bar; "truncated importance sampling"). -> weights
    (B, T), 0 on padding, and metrics: is_weight_mean, is_truncated_frac (share of valid tokens
    at the cap), is_log_ratio_abs (mean |log pi_old - log mu|).
    """
    if cap < 1.0:
        raise ValueError(f"importance-weight cap must be >= 1, got {cap}")
    valid = mask.bool()
    log_ratio = torch.where(valid, old_logprobs - behaviour_logprobs, 0.0)
    raw = torch.exp(log_ratio)
    weights = torch.where(valid, raw.clamp(max=cap), 0.0)
    metrics = {
        "is_weight_mean": masked_mean(weights, valid).item(),
        "is_truncated_frac": masked_mean((raw > cap).to(raw.dtype), valid).item(),
        "is_log_ratio_abs": masked_mean(log_ratio.abs(), valid).item(),
    }
    return weights, metrics


POLICY_LOSSES = Registry("policy loss")
POLICY_LOSSES["ppo"] = ppo_policy_loss
POLICY_LOSSES["grpo"] = grpo_policy_loss


def explained_variance(predictions: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[targets - predictions] / Var[targets] over valid tokens; NaN when Var[targets]
    is 0 (as CleanRL). 1 is a perfect critic, 0 no better than a constant, < 0 worse."""
    with torch.no_grad():
        var_targets = masked_var(targets, mask, unbiased=False)
        var_residual = masked_var(targets - predictions, mask, unbiased=False)
        if var_targets == 0:
            return float("nan")
        return (1.0 - var_residual / var_targets).item()


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range_value: float | None = 0.2,
    agg: str = "token-mean",
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value-function loss.

    values (critic, with grad), old_values (critic at rollout), returns (GAE targets), mask:
    (B, T) -> (loss (), metrics).

        V_clip = old_values + clip(values - old_values, -clip_range_value, clip_range_value)
        L_t    = 0.5 * max((values - returns)^2, (V_clip - returns)^2)

    clip_range_value=None gives the unclipped 0.5 * (values - returns)^2. Aggregated with
    `agg` (default "token-mean"). metrics: vf_clipfrac = share of valid tokens where the
    clipped error is the larger one, explained_variance of returns by values.

    Source: CleanRL `ppo.py` (clip_vloss); verl `compute_value_loss`; the "value clipping"
    detail of Engstrom et al. 2020 / Andrychowicz et al. 2021.
    """
    valid = mask.bool()
    values = torch.where(valid, values, 0.0)
    old_values = torch.where(valid, old_values, 0.0)
    returns = torch.where(valid, returns, 0.0)
    unclipped = (values - returns) ** 2
    if clip_range_value is None:
        clipped = unclipped
    else:
        v_clip = old_values + torch.clamp(values - old_values, -clip_range_value, clip_range_value)
        clipped = (v_clip - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped, clipped)
    metrics = {
        "vf_clipfrac": masked_mean((clipped > unclipped).to(values.dtype), valid).item(),
        "explained_variance": explained_variance(values, returns, valid),
    }
    return aggregate_loss(per_token, mask, agg, normalizer), metrics


def bradley_terry_loss(
    r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Pairwise reward-model loss: -log sigmoid(r_chosen - r_rejected - margin), batch mean.

    r_chosen, r_rejected: (B,) scalar rewards of the preferred / dispreferred response;
    margin: (B,) or scalar, the required gap (Llama 2's preference-strength margin), None = 0.
    -> (loss (), metrics). metrics: accuracy = share with r_chosen > r_rejected (ties count
    as wrong), reward_margin = mean(r_chosen - r_rejected), chosen_reward, rejected_reward.

    Source: Bradley & Terry 1952; Ouyang et al. 2022 (InstructGPT) eq. 1; Touvron et al. 2023
    (Llama 2) eq. 2 for the margin.
    """
    diff = r_chosen - r_rejected  # (B,)
    logits = diff if margin is None else diff - margin
    loss = -F.logsigmoid(logits).mean()
    return loss, _pair_metrics(r_chosen, r_rejected)


@torch.no_grad()
def _pair_metrics(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> dict[str, float]:
    """Pairwise accuracy (ties count as wrong), mean margin, mean chosen and rejected reward."""
    diff = r_chosen - r_rejected
    return {
        "accuracy": (diff > 0).float().mean().item(),
        "reward_margin": diff.mean().item(),
        "chosen_reward": r_chosen.mean().item(),
        "rejected_reward": r_rejected.mean().item(),
    }


def ensemble_bradley_terry_loss(
    r_chosen: torch.Tensor, r_rejected: torch.Tensor, weights: torch.Tensor | None = None, margin: float = 0.0
) -> tuple[torch.Tensor, dict[str, float]]:
    """Bradley-Terry loss of K reward heads at once, each on its own bootstrap weights.

    r_chosen, r_rejected: (B, K) rewards of K ensemble members; weights: (B, K) non-negative
    pair weights of each member (a Poisson(1) bootstrap: member k sees pair b weights[b, k]
    times), None = all 1. -> (loss (), metrics) where

        loss = mean_k [ sum_b w_bk * -log sigmoid(r_c,bk - r_r,bk - margin) / sum_b w_bk ]

    A member whose weights in this batch sum to 0 adds 0. With K = 1 and no weights this is
    `bradley_terry_loss` exactly. metrics: the members' mean (unweighted) pairwise accuracy,
    reward margin, chosen and rejected reward.

    Source: the online (Poisson) bootstrap, Oza & Russell 2001; ensembles of reward models,
    Coste et al. 2023 (members from different seeds), Zhang et al. 2024 (members sharing a backbone).
    """
    if r_chosen.shape != r_rejected.shape or r_chosen.dim() != 2:
        raise ValueError(f"r_chosen and r_rejected must both be (B, K), got {tuple(r_chosen.shape)} and "
                         f"{tuple(r_rejected.shape)}")
    diff = r_chosen - r_rejected  # (B, K)
    per_pair = -F.logsigmoid(diff - margin)  # (B, K)
    if weights is None:
        loss = per_pair.mean(0).mean()
    else:
        if weights.shape != per_pair.shape:
            raise ValueError(f"weights must be (B, K) = {tuple(per_pair.shape)}, got {tuple(weights.shape)}")
        weights = weights.to(per_pair.dtype)
        totals = weights.sum(0)  # (K,)
        loss = ((weights * per_pair).sum(0) / totals.clamp_min(1e-12)).mean()
    return loss, _pair_metrics(r_chosen, r_rejected)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Log-probability of each label under softmax(logits).

    logits: (B, T, V), labels: (B, T) long -> (B, T), float32 for half-precision logits
    (else logits' dtype).

        logp = logits[label] - logsumexp(logits)

    Never materialises a full (B, T, V) log_softmax: the logsumexp runs over chunks of
    `chunk_size` token positions, each upcast to float32 if needed, so the extra memory is
    one (chunk_size, V) block (plus what autograd keeps for backward). Logits must already be
    divided by the sampling temperature if the rollout used one.
    Source: verl `logprobs_from_logits_v2`; TRL `selective_log_softmax`.
    """
    out_dtype = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
    flat = logits.reshape(-1, logits.shape[-1])  # (B*T, V)
    label_logits = flat.gather(-1, labels.reshape(-1, 1)).squeeze(-1).to(out_dtype)  # (B*T,)
    lse = torch.cat([torch.logsumexp(c.to(out_dtype), dim=-1) for c in flat.split(chunk_size)])
    return (label_logits - lse).reshape(labels.shape)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of softmax(logits) per position. (B, T, V) -> (B, T), dtype as logprobs_from_logits.

        H = logsumexp(z) - sum_v softmax(z)_v z_v

    Chunked over positions like `logprobs_from_logits`. Source: verl `entropy_from_logits`.
    """
    out_dtype = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
    flat = logits.reshape(-1, logits.shape[-1])  # (B*T, V)
    parts = []
    for c in flat.split(chunk_size):
        c = c.to(out_dtype)
        parts.append(torch.logsumexp(c, dim=-1) - (torch.softmax(c, dim=-1) * c).sum(-1))
    return torch.cat(parts).reshape(logits.shape[:-1])
