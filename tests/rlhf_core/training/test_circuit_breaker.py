"""The circuit breaker decision, table-driven: each condition trips exactly when it should."""
import math

import pytest

from rlhf_core.config import CircuitBreakerConfig, ConfigError, parse_config
from rlhf_core.training.circuit_breaker import prob_diff_bound, should_trip

BOUND = 10.0


def steps(**series) -> list[dict]:
    """History rows from per-metric lists: steps(kl=[1, 2]) -> [{step 1, policy/kl 1}, ...]."""
    names = {"kl": "policy/kl", "skipped": "policy/nonfinite_skipped", "entropy": "policy/entropy",
             "reward": "policy/reward_mean", "proxy": "policy/rm_score_mean", "audit": "policy/audit_score_mean",
             "spread": "policy/ensemble_disagreement", "drift": "rollout/prob_diff"}
    n = max(len(v) for v in series.values())
    return [{"step": i + 1, **{names[k]: v[i] for k, v in series.items() if i < len(v)}} for i in range(n)]


ALL_ON = CircuitBreakerConfig(entropy_floor=0.05, max_reward_drop=0.5, max_audit_drop=0.3, max_disagreement=0.5)


@pytest.mark.parametrize(
    "history, limits, expected",
    [
        pytest.param(steps(kl=[1, 2, 3]), ALL_ON, None, id="healthy"),
        pytest.param(steps(kl=[11, 12, 13]), ALL_ON, "kl_above_bound", id="kl-3-in-a-row"),
        pytest.param(steps(kl=[11, 12, 9, 13, 14]), ALL_ON, None, id="kl-streak-broken"),
        pytest.param(steps(kl=[1, 11, 12]), ALL_ON, None, id="kl-only-2-of-3"),
        pytest.param(steps(kl=[10, 10, 10]), ALL_ON, None, id="kl-at-the-bound-is-fine"),
        pytest.param(steps(kl=[11, math.nan, 12]), ALL_ON, "kl_above_bound", id="nan-kl-counts-as-above"),
        pytest.param(steps(kl=[11, 12]), ALL_ON, None, id="too-few-steps"),
        pytest.param(steps(skipped=[0, 1, 0, 1]), ALL_ON, None, id="isolated-nonfinite-tolerated"),
        pytest.param(steps(skipped=[0, 1, 1]), ALL_ON, "nonfinite_loss", id="nonfinite-2-in-a-row"),
        pytest.param(steps(entropy=[0.5, 0.01, 0.01, 0.01]), ALL_ON, "entropy_collapse", id="entropy-floor"),
        pytest.param(steps(entropy=[0.01, 0.01, 0.01]), CircuitBreakerConfig(), None, id="entropy-check-off"),
        pytest.param(steps(reward=[1, 1, 1, 0.2, 0.2, 0.2]), ALL_ON, "reward_collapse", id="reward-drop"),
        pytest.param(steps(reward=[1, 1, 1, 0.8, 0.8, 0.8]), ALL_ON, None, id="reward-drop-within-limit"),
        pytest.param(steps(reward=[0.2, 0.5, 1, 1.2]), ALL_ON, None, id="reward-rising"),
        pytest.param(steps(reward=[1, 1, 1, 0, 0, 0]), CircuitBreakerConfig(), None, id="reward-check-off"),
        # windows of 3 below: audit means 1, 0.83, 0.67, 0.5 (drop 0.5 from the best, 1.0)
        pytest.param(steps(proxy=[0, 0, 0, 1, 1, 1], audit=[1, 1, 1, 0.5, 0.5, 0.5]), ALL_ON, "over_optimisation",
                     id="proxy-up-audit-down"),
        pytest.param(steps(proxy=[0.5] * 6, audit=[1, 1, 1, 0.5, 0.5, 0.5]), ALL_ON, "over_optimisation",
                     id="proxy-flat-audit-down"),
        pytest.param(steps(proxy=[1, 1, 1, 0, 0, 0], audit=[1, 1, 1, 0.5, 0.5, 0.5]), ALL_ON, None,
                     id="both-fall-is-collapse-not-hacking"),
        pytest.param(steps(proxy=[0, 0, 0, 1, 1, 1], audit=[1, 1, 1, 0.8, 0.8, 0.8]), ALL_ON, None,
                     id="audit-drop-within-limit"),
        pytest.param(steps(proxy=[0, 0.5, 1, 1.5], audit=[0, 0.5, 1, 1.5]), ALL_ON, None, id="both-rise"),
        pytest.param(steps(proxy=[0, 1, 1], audit=[1, 0, 0]), ALL_ON, None, id="audit-too-few-steps"),
        pytest.param(steps(proxy=[0, 0, 0, 1, 1, 1, 1], audit=[1, 1, 1, 0.5, 0.5, 0.5]), ALL_ON, None,
                     id="step-without-audit-never-trips"),
        pytest.param(steps(proxy=[0, 0, 0, 1, 1, 1]), ALL_ON, None, id="no-audit-model"),
        pytest.param(steps(proxy=[0, 0, 0, 1, 1, 1], audit=[1, 1, 1, 0, 0, 0]), CircuitBreakerConfig(), None,
                     id="audit-check-off"),
        pytest.param(steps(spread=[0.1, 0.6, 0.7, 0.8]), ALL_ON, "over_optimisation", id="disagreement-above"),
        pytest.param(steps(spread=[0.1, 0.1, 0.9]), ALL_ON, None, id="disagreement-spike-averaged-out"),
        pytest.param(steps(spread=[0.9, 0.9]), ALL_ON, None, id="disagreement-too-few-steps"),
        pytest.param(steps(spread=[0.9, 0.9, 0.9]), CircuitBreakerConfig(), None, id="disagreement-check-off"),
        pytest.param(steps(kl=[50, 50, 50]), CircuitBreakerConfig(enabled=False), None, id="disabled"),
        pytest.param([], ALL_ON, None, id="no-history"),
    ],
)
def test_should_trip(history, limits, expected):
    trip = should_trip(history, limits, BOUND)
    assert (None if trip is None else trip.reason) == expected
    if trip is not None:
        assert trip.step == history[-1]["step"] and trip.message.startswith("circuit breaker:")


@pytest.mark.parametrize(
    "drift, bound, expected",
    [
        pytest.param([0.002, 0.003, 0.004], 0.01, None, id="in-sync"),
        pytest.param([0.2, 0.2, 0.2], 0.01, "sync_drift", id="engine-keeps-old-weights"),
        pytest.param([0.02, 0.005, 0.02, 0.02], 0.01, None, id="streak-broken"),
        pytest.param([0.02, math.nan, 0.02], 0.01, "sync_drift", id="nan-counts-as-above"),
        pytest.param([0.2, 0.2], 0.01, None, id="too-few-steps"),
        pytest.param([0.2, 0.2, 0.2], None, None, id="no-bound-no-check"),
    ],
)
def test_sync_drift(drift, bound, expected):
    trip = should_trip(steps(drift=drift), ALL_ON, BOUND, bound)
    assert (None if trip is None else trip.reason) == expected


def test_the_drift_bound_follows_the_trainers_precision_and_is_off_for_lagged_rollouts():
    limits = CircuitBreakerConfig()
    assert prob_diff_bound(limits, "fp32", 0) == limits.max_prob_diff_fp32 == 0.01
    assert prob_diff_bound(limits, "bf16", 0) == limits.max_prob_diff_bf16 == 0.05
    assert prob_diff_bound(limits, "fp32", 1) is None  # pipelined: the lag is part of the gap by design
    assert prob_diff_bound(CircuitBreakerConfig(max_prob_diff_fp32=None), "fp32", 0) is None
    trip = should_trip(steps(drift=[0.2, 0.3, 0.25]), limits, BOUND, 0.01)
    assert trip.message == ("circuit breaker: the rollout engine's token probabilities differ from the trainer's by "
                            "0.25 on average (rollout/prob_diff), above 0.01, for 3 consecutive steps (step 3): the "
                            "engine is not sampling from the trainer's weights")


def test_the_first_condition_in_order_is_reported_and_the_message_has_the_numbers():
    history = steps(kl=[11, 12, 13.5], skipped=[1, 1, 1])
    trip = should_trip(history, ALL_ON, BOUND)
    assert trip.reason == "kl_above_bound"
    assert trip.message == "circuit breaker: KL to the reference 13.5 above the bound 10 for 3 consecutive steps (step 3)"


def test_reward_window_mean_against_the_best_earlier_window():
    # windows of 2: means 1.0, 1.0, 0.75, 0.4 -> best earlier 1.0, now 0.4: drop 0.6 > 0.5
    trip = should_trip(steps(reward=[1, 1, 1, 0.5, 0.3]), CircuitBreakerConfig(max_reward_drop=0.5, reward_window=2), BOUND)
    assert trip.reason == "reward_collapse" and "fell 0.6 below the run's best 1" in trip.message


def test_audit_window_mean_against_the_best_earlier_window_and_the_proxy_there():
    # windows of 2: audit means 1.0, 0.7, 0.4, proxy means 0.2, 0.4, 0.6 -> audit fell 0.6 from
    # its best while the proxy rose from 0.2
    limits = CircuitBreakerConfig(max_audit_drop=0.3, audit_window=2)
    trip = should_trip(steps(proxy=[0.2, 0.2, 0.6, 0.6], audit=[1, 1, 0.4, 0.4]), limits, BOUND)
    assert trip.reason == "over_optimisation"
    assert trip.message == ("circuit breaker: audit reward-model score over the last 2 steps 0.4 fell 0.6 below its "
                            "best 1 while the proxy score went from 0.2 to 0.6 (max drop 0.3, step 4)")


def test_the_proxy_is_compared_at_the_latest_window_of_the_audit_best():
    # audit best (1) at steps 1 and 2; the proxy was 0 at step 1 but 1 at step 2, and fell to 0.8
    # with the audit since then: a collapse of both, not a proxy rising against the audit
    limits = CircuitBreakerConfig(max_audit_drop=0.3, audit_window=1)
    assert should_trip(steps(proxy=[0, 1, 0.8], audit=[1, 1, 0.5]), limits, BOUND) is None


def test_disagreement_message_has_the_numbers():
    trip = should_trip(steps(spread=[0.4, 0.6, 0.8]), CircuitBreakerConfig(max_disagreement=0.5), BOUND)
    assert trip.message == ("circuit breaker: reward-model ensemble disagreement over the last 3 steps 0.6 above 0.5 "
                            "(step 3)")


@pytest.mark.parametrize("field, bound", [("kl_patience", ">= 1"), ("audit_window", ">= 1"),
                                          ("max_audit_drop", "> 0"), ("max_disagreement", "> 0")])
def test_config_bounds_are_named(field, bound):
    with pytest.raises(ConfigError, match=f"policy.circuit_breaker.{field}: must be {bound}, got 0"):
        parse_config({"policy": {"circuit_breaker": {field: 0}}})
