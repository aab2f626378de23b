"""The pure math of RLHF: masked reductions, advantage estimators, KL estimators and
controllers, and losses. Tensors in, `(value, metrics)` out; torch only, no distributed,
orchestration or tracking imports. B = sequences in the batch, T = response tokens.
"""
from rlhf_core.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    gae,
    grpo_advantages,
    register_advantage,
    whiten,
)
from rlhf_core.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalized_rewards,
    last_token_index,
    score_on_last_token,
)
from rlhf_core.algos.losses import (
    AGG_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    bradley_terry_loss,
    entropy_from_logits,
    explained_variance,
    grpo_policy_loss,
    logprobs_from_logits,
    loss_normalizer,
    ppo_policy_loss,
    truncated_is_weights,
    value_loss,
)
from rlhf_core.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rlhf_core.algos.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "Registry",
    "aggregate_loss",
    "bradley_terry_loss",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "grpo_advantages",
    "grpo_policy_loss",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalized_rewards",
    "last_token_index",
    "logprobs_from_logits",
    "loss_normalizer",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
    "register_advantage",
    "score_on_last_token",
    "truncated_is_weights",
    "value_loss",
    "whiten",
]
