"""KL divergence to the reference policy: per-token estimators, coefficient controllers, and
the KL-shaped token rewards of RLHF.

Tokens are sampled from the policy pi, so every estimator is a single-sample estimate of
KL(pi || ref) at that token, with log r = ref_logprob - logprob (Schulman's notation,
r = p(x)/q(x) with x ~ q = pi and p = ref):

    k1 = -log r                 unbiased, high variance, can be negative
    k2 = 0.5 * (log r)^2        biased (low bias when pi ~ ref), always >= 0
    k3 = (r - 1) - log r        unbiased, always >= 0, low variance ("low_var_kl" in verl)

Source: J. Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html.
No clamping is applied (verl clamps k3 to [-10, 10]); inputs are assumed finite.
"""
from __future__ import annotations

from typing import Any

import torch

from rlhf_core.algos.masked import masked_mean, masked_sum
from rlhf_core.algos.registry import Registry

KL_ESTIMATORS = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = logprobs - ref_logprobs. (B, T), (B, T) -> (B, T); elementwise, no masking."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (logprobs - ref_logprobs)^2. (B, T), (B, T) -> (B, T); elementwise."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = (r - 1) - log r with log r = ref_logprobs - logprobs. (B, T) -> (B, T); elementwise.

    `expm1` keeps the r - 1 term accurate when pi ~ ref, where k3 ~ 0.5 (log r)^2 is tiny.
    """
    log_ratio = ref_logprobs - logprobs
    return torch.expm1(log_ratio) - log_ratio


class FixedKLController:
    """A constant KL coefficient beta; `update` is a no-op. Ziegler et al. 2019, fixed beta."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adapts beta so the observed KL tracks `target` (Ziegler et al. 2019, section 2.2):

        e    = clip(current_kl / target - 1, -0.2, 0.2)
        beta = beta * (1 + e * n_steps / horizon)

    n_steps is the number of samples (sequences) seen since the last update, as in the paper
    and TRL; horizon is in the same unit. `current_kl` must be measured the way `target` is
    meant: `kl_penalized_rewards` reports both the per-sequence sum ("kl", the paper's and
    TRL's unit, target ~ 6) and the per-token mean ("kl_per_token", verl's unit).
    Source: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences";
    TRL / verl `AdaptiveKLController`.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be > 0, got {target}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last set position of each row. mask: (B, T) -> (B,) long; 0 for empty rows."""
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask.bool(), positions, 0).amax(dim=-1)


def score_on_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token rewards (B, T) that are 0 but for each row's sequence score on its last valid
    token; a row with no valid token gets nothing. scores: (B,), mask: (B, T)."""
    mask = mask.bool()
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    rewards = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last_token_index(mask)] = torch.where(mask.any(dim=-1), scores.to(rewards.dtype), 0.0)
    return rewards


@torch.no_grad()
def kl_penalized_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
    kl_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token rewards of RLHF: a KL penalty on every response token plus the reward-model
    score on the last one.

    scores: (B,); logprobs, ref_logprobs (of the sampled tokens), mask: (B, T)
    -> token_rewards (B, T), metrics.

        token_rewards[b, t] = -kl_coef * kl[b, t] + (t == last valid token of b) * scores[b]

    Masked positions are 0; a row with no valid token gets nothing (its score is dropped).
    metrics: "kl" = batch mean of the per-sequence KL sum, "kl_per_token" = mean over all
    valid tokens, "kl_coef", "score_mean". k1 is the default, as in Ziegler et al. 2019,
    InstructGPT and TRL.

    kl_weights (B, T), optional: importance weights pi / mu of tokens sampled from another
    policy mu (pipelined rollouts); the penalty becomes kl_coef * w * kl, an estimate of the
    same expectation under pi. Without them, a token mu liked and pi no longer does has an
    unbounded k3 (exp(log ref - log pi)) that swamps the batch.

    Source: Ziegler et al. 2019; Stiennon et al. 2020 (eq. 2); TRL `compute_rewards`.
    """
    mask = mask.bool()
    kl = KL_ESTIMATORS[estimator](logprobs, ref_logprobs)
    if kl_weights is not None:
        kl = kl * kl_weights
    kl = torch.where(mask, kl, 0.0)  # (B, T)
    rewards = -kl_coef * kl + score_on_last_token(scores, mask)
    metrics = {
        "kl": masked_sum(kl, mask, dim=-1).mean().item(),
        "kl_per_token": masked_mean(kl, mask).item(),
        "kl_coef": float(kl_coef),
        "score_mean": scores.float().mean().item(),
    }
    return rewards, metrics
