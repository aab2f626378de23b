"""The in-loop circuit breaker: should RL training stop now, before it does more harm?

`should_trip(history, limits, kl_bound, prob_diff_bound)` is a pure function of the run's per-step metrics
(oldest first, as the trainer records them) and returns the first condition that holds at
the last step, or None. Every rank computes it from the same gathered metrics, so all ranks
stop at the same step. Conditions, each over the last `patience` steps:

    kl_above_bound      policy/kl > kl_bound at each of the last `kl_patience` steps
                        (a NaN KL counts as above: an unmeasurable policy is not a safe one)
    sync_drift          rollout/prob_diff, the mean |p_engine - p_trainer| of the sampled
                        tokens, above `prob_diff_bound` at each of the last `sync_patience`
                        steps: the engine samples from weights other than the trainer's (a
                        weight sync that did nothing, or only part of it) or computes too far
                        from them. The bound is the trainer's precision's (`prob_diff_bound`);
                        None (pipelined rollouts, whose lag is part of the gap): off
    nonfinite_loss      an optimizer step was skipped for a NaN/Inf loss or gradient at each
                        of the last `max_consecutive_nonfinite` steps (one skip alone is
                        ZeRO's normal protection and is tolerated)
    entropy_collapse    policy/entropy < entropy_floor at each of the last `entropy_patience`
                        steps (off when entropy_floor is None)
    reward_collapse     the mean reward of the last `reward_window` steps is more than
                        `max_reward_drop` below the best such mean earlier in the run (off
                        when max_reward_drop is None)
    over_optimisation   reward hacking, either of (each off while its limit is None; means
                        over `audit_window` steps, only at a step that recorded the metric):
                        - the mean held-out audit reward-model score (policy/audit_score_mean)
                          is more than `max_audit_drop` below its best earlier mean while the
                          mean proxy score (policy/rm_score_mean) is at or above its mean at
                          that best window: the proxy rewards what the audit model does not
                          (both falling together is a collapse, not this)
                        - the mean std across the reward-model ensemble's members
                          (policy/ensemble_disagreement) is above `max_disagreement`: the
                          policy went where the reward models no longer agree

The trainer trips the same way, with reason `sync_failed`, when the rollout engine fails its
check after a weight sync twice (`rlhf_core.distributed.policy_sync`).

What the trainer does on a trip (`rlhf_core.distributed.policy_trainer`): it stops without
writing a checkpoint for the tripping step, so the last checkpoint is the last good one,
does not save the policy, and the stage fails with the trip's message.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rlhf_core.config import CircuitBreakerConfig
from rlhf_core.training.stage_types import StageFailed

PROXY = "policy/rm_score_mean"  # the score the policy is trained on
AUDIT = "policy/audit_score_mean"  # a held-out reward model's score of the same rollouts
DISAGREEMENT = "policy/ensemble_disagreement"  # mean over rollouts of the std across members
PROB_DIFF = "rollout/prob_diff"  # mean |p_engine - p_trainer| of the sampled tokens


@dataclass(frozen=True)
class Trip:
    reason: str  # one of the condition codes above
    message: str
    step: int


class CircuitBreakerTripped(StageFailed):
    """The stage stopped itself. `checkpoint_path` is the last checkpoint written before the
    trip (None if it tripped before the first one)."""

    def __init__(self, trip: Trip, checkpoint_path: str | None):
        super().__init__(f"{trip.message}; last good checkpoint: {checkpoint_path or 'none'}")
        self.trip, self.checkpoint_path = trip, checkpoint_path


def _last(history: Sequence[Mapping[str, float]], key: str, n: int) -> list[float] | None:
    """The last `n` values of `key`, or None when fewer than `n` steps recorded it."""
    values = [h[key] for h in history if key in h][-n:]
    return values if len(values) == n else None


def _above(x: float, bound: float) -> bool:
    return math.isnan(x) or x > bound


def _window_means(values: list[float], window: int) -> list[float]:
    return [sum(values[i - window : i]) / window for i in range(window, len(values) + 1)]


def prob_diff_bound(limits: CircuitBreakerConfig, precision: str, max_lag: int) -> float | None:
    """The sync-drift bound of a trainer computing in `precision` (fp32, bf16) whose rollouts
    lag `max_lag` updates (`policy.pipeline.max_lag`); None: no check."""
    if max_lag > 0:
        return None
    return limits.max_prob_diff_bf16 if precision == "bf16" else limits.max_prob_diff_fp32


def should_trip(
    history: Sequence[Mapping[str, float]], limits: CircuitBreakerConfig, kl_bound: float,
    prob_diff_bound: float | None = None,
) -> Trip | None:
    if not limits.enabled or not history:
        return None
    step = int(history[-1].get("step", len(history)))

    kl = _last(history, "policy/kl", limits.kl_patience)
    if kl is not None and all(_above(x, kl_bound) for x in kl):
        return Trip("kl_above_bound", f"circuit breaker: KL to the reference {kl[-1]:.4g} above the bound "
                    f"{kl_bound:g} for {limits.kl_patience} consecutive steps (step {step})", step)

    if prob_diff_bound is not None:
        drift = _last(history, PROB_DIFF, limits.sync_patience)
        if drift is not None and all(_above(x, prob_diff_bound) for x in drift):
            return Trip("sync_drift", f"circuit breaker: the rollout engine's token probabilities differ from the "
                        f"trainer's by {drift[-1]:.4g} on average ({PROB_DIFF}), above {prob_diff_bound:g}, for "
                        f"{limits.sync_patience} consecutive steps (step {step}): the engine is not sampling from "
                        f"the trainer's weights", step)

    skipped = _last(history, "policy/nonfinite_skipped", limits.max_consecutive_nonfinite)
    if skipped is not None and all(x > 0 for x in skipped):
        return Trip("nonfinite_loss", f"circuit breaker: non-finite loss or gradients at "
                    f"{limits.max_consecutive_nonfinite} consecutive steps (step {step})", step)

    if limits.entropy_floor is not None:
        entropy = _last(history, "policy/entropy", limits.entropy_patience)
        if entropy is not None and all(x < limits.entropy_floor for x in entropy):
            return Trip("entropy_collapse", f"circuit breaker: policy entropy {entropy[-1]:.4g} below the floor "
                        f"{limits.entropy_floor:g} for {limits.entropy_patience} consecutive steps (step {step})", step)

    if limits.max_reward_drop is not None:
        rewards = [h["policy/reward_mean"] for h in history if "policy/reward_mean" in h]
        means = _window_means(rewards, limits.reward_window)
        if len(means) >= 2:
            best, now = max(means[:-1]), means[-1]
            if best - now > limits.max_reward_drop:
                return Trip("reward_collapse", f"circuit breaker: mean reward over the last {limits.reward_window} "
                            f"steps {now:.4g} fell {best - now:.4g} below the run's best {best:.4g} "
                            f"(max drop {limits.max_reward_drop:g}, step {step})", step)

    return _over_optimisation(history, limits, step)


def _over_optimisation(history: Sequence[Mapping[str, float]], limits: CircuitBreakerConfig, step: int) -> Trip | None:
    window, last = limits.audit_window, history[-1]
    if limits.max_audit_drop is not None and AUDIT in last and PROXY in last:
        scored = [h for h in history if AUDIT in h and PROXY in h]
        audit = _window_means([h[AUDIT] for h in scored], window)
        proxy = _window_means([h[PROXY] for h in scored], window)
        if len(audit) >= 2:
            # the latest window at the audit's best: a proxy risen since then rose while the audit fell
            best_at = max(range(len(audit) - 1), key=lambda i: (audit[i], i))
            drop = audit[best_at] - audit[-1]
            if drop > limits.max_audit_drop and proxy[-1] >= proxy[best_at]:
                return Trip("over_optimisation", f"circuit breaker: audit reward-model score over the last {window} "
                            f"steps {audit[-1]:.4g} fell {drop:.4g} below its best {audit[best_at]:.4g} while the "
                            f"proxy score went from {proxy[best_at]:.4g} to {proxy[-1]:.4g} "
                            f"(max drop {limits.max_audit_drop:g}, step {step})", step)

    if limits.max_disagreement is not None and DISAGREEMENT in last:
        spread = _last(history, DISAGREEMENT, window)
        if spread is not None and sum(spread) / window > limits.max_disagreement:
            return Trip("over_optimisation", f"circuit breaker: reward-model ensemble disagreement over the last "
                        f"{window} steps {sum(spread) / window:.4g} above {limits.max_disagreement:g} "
                        f"(step {step})", step)
    return None
