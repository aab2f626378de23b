import math

import pytest
import torch
from torch.testing import assert_close

from rlhf_core.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalized_rewards,
    last_token_index,
)

DT = torch.float64


def _distributions(seed=0, V=10, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(V, generator=g, dtype=DT), -1)  # policy pi
    logq = torch.log_softmax(logp + spread * torch.randn(V, generator=g, dtype=DT), -1)  # reference
    return logp, logq


def _exact_kl(logp, logq):
    return (logp.exp() * (logp - logq)).sum()


@pytest.mark.parametrize("name", ["k1", "k3"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unbiased_estimators_have_the_exact_kl_as_expectation(name, seed):
    logp, logq = _distributions(seed)
    expectation = (logp.exp() * KL_ESTIMATORS[name](logp, logq)).sum()  # E_{x~pi}[k(x)], exactly
    assert_close(expectation, _exact_kl(logp, logq))


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_sample_mean_estimates_kl(name):
    logp, logq = _distributions(seed=3, spread=0.3)  # close distributions: k2's bias is small
    g = torch.Generator().manual_seed(0)
    x = torch.multinomial(logp.exp(), 200_000, replacement=True, generator=g)
    k = KL_ESTIMATORS[name](logp[x], logq[x])
    exact = _exact_kl(logp, logq).item()
    stderr = k.std().item() / math.sqrt(k.numel())
    tolerance = 5 * stderr if name != "k2" else 0.1 * exact
    assert abs(k.mean().item() - exact) < tolerance


def test_k3_has_lower_variance_than_k1_for_close_distributions():
    logp, logq = _distributions(seed=4, spread=0.3)
    p = logp.exp()
    k1, k3 = kl_k1(logp, logq), kl_k3(logp, logq)
    var = lambda k: (p * k**2).sum() - (p * k).sum() ** 2  # noqa: E731
    assert var(k3) < var(k1)


def test_k3_is_never_negative_and_k1_can_be():
    g = torch.Generator().manual_seed(0)
    logprobs = -5 * torch.rand(10_000, generator=g, dtype=DT)
    ref_logprobs = -5 * torch.rand(10_000, generator=g, dtype=DT)
    assert (kl_k3(logprobs, ref_logprobs) >= 0).all()
    assert (kl_k1(logprobs, ref_logprobs) < 0).any()
    assert (kl_k3(logprobs, logprobs) == 0).all()


def test_closed_forms():
    logprobs = torch.tensor([-1.0, -2.0, -0.5], dtype=DT)
    ref = torch.tensor([-1.5, -1.0, -0.5], dtype=DT)
    log_r = ref - logprobs
    assert_close(kl_k1(logprobs, ref), -log_r)
    assert_close(kl_k2(logprobs, ref), 0.5 * log_r**2)
    assert_close(kl_k3(logprobs, ref), (log_r.exp() - 1) - log_r)


def test_k3_stays_accurate_for_tiny_differences():
    logprobs = torch.tensor([-1.0], dtype=torch.float32)
    ref = logprobs + 1e-4
    assert_close(kl_k3(logprobs, ref), torch.tensor([0.5e-8]), rtol=1e-3, atol=0)


def test_fixed_controller_never_moves():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=1000)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_adaptive_controller_hand_computed_update():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10_000)
    ctl.update(current_kl=6.6, n_steps=256)  # error = 6.6 / 6 - 1 = 0.1
    assert ctl.value == pytest.approx(0.1 * (1 + 0.1 * 256 / 10_000))
    ctl.update(current_kl=6.0, n_steps=256)  # on target: unchanged
    assert ctl.value == pytest.approx(0.1 * (1 + 0.1 * 256 / 10_000))


@pytest.mark.parametrize("current_kl,error", [(100.0, 0.2), (0.0, -0.2), (6.0 * 1.2, 0.2), (3.0, -0.2)])
def test_adaptive_controller_clips_the_error(current_kl, error):
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=1000)
    ctl.update(current_kl, n_steps=100)
    assert ctl.value == pytest.approx(0.2 * (1 + error * 100 / 1000))


def test_adaptive_controller_state_dict_round_trip():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=1000)
    for kl in (3.0, 9.0, 7.0):
        ctl.update(kl, n_steps=64)
    resumed = AdaptiveKLController(1.0, target=1.0, horizon=1.0)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.state_dict() == ctl.state_dict()
    ctl.update(8.0, 64)
    resumed.update(8.0, 64)
    assert resumed.value == ctl.value


def test_adaptive_controller_rejects_bad_settings():
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=1.0, horizon=0)


def test_last_token_index():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]])
    assert last_token_index(mask).tolist() == [1, 3, 0, 2]


def test_kl_penalized_rewards_hand_computed():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, 9.0], [-1.0, -1.0, 9.0, 9.0], [9.0] * 4], dtype=DT)
    ref = torch.tensor([[-1.5, -1.0, -0.5, -9.0], [-2.0, -1.0, -9.0, -9.0], [-9.0] * 4], dtype=DT)
    scores = torch.tensor([2.0, -1.0, 5.0], dtype=DT)
    rewards, metrics = kl_penalized_rewards(scores, logprobs, ref, mask, kl_coef=0.1, estimator="k1")
    expected = torch.tensor(
        [[-0.05, 0.1, 0.0 + 2.0, 0.0], [-0.1, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=DT
    )
    assert_close(rewards, expected)
    # per-sequence KL sums: 0.5 - 1 + 0 = -0.5, 1 + 0 = 1, 0; valid tokens: 5
    assert metrics["kl"] == pytest.approx((-0.5 + 1.0 + 0.0) / 3)
    assert metrics["kl_per_token"] == pytest.approx(0.5 / 5)
    assert metrics["kl_coef"] == 0.1


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalized_rewards_uses_the_estimator_and_sums_to_score_minus_kl(estimator):
    g = torch.Generator().manual_seed(0)
    logprobs, ref = -torch.rand(3, 5, generator=g, dtype=DT), -torch.rand(3, 5, generator=g, dtype=DT)
    mask = torch.arange(5) < torch.tensor([[5], [2], [4]])
    scores = torch.tensor([1.0, 2.0, 3.0], dtype=DT)
    rewards, _ = kl_penalized_rewards(scores, logprobs, ref, mask, kl_coef=0.2, estimator=estimator)
    kl = KL_ESTIMATORS[estimator](logprobs, ref) * mask
    assert_close(rewards.sum(-1), scores - 0.2 * kl.sum(-1))
    assert (rewards[~mask] == 0).all()


def test_kl_penalty_of_lagged_samples_is_importance_weighted():
    # pipelined rollouts: token 1 was likely under the sampler but is e^-16 under pi now, so its
    # k3 is ~e^16; weighted by pi / mu (~e^-16) it is back to O(1) instead of swamping the batch
    logprobs = torch.tensor([[-0.5, -16.0]], dtype=DT)
    ref = torch.tensor([[-0.7, -0.04]], dtype=DT)
    weights = torch.tensor([[1.0, math.exp(-16.0)]], dtype=DT)
    mask = torch.ones(1, 2, dtype=torch.bool)
    rewards, metrics = kl_penalized_rewards(torch.tensor([1.0], dtype=DT), logprobs, ref, mask, kl_coef=0.1,
                                            estimator="k3", kl_weights=weights)
    k3 = torch.expm1(ref - logprobs) - (ref - logprobs)
    assert k3[0, 1] > 8e6
    assert_close(rewards, torch.tensor([[-0.1 * k3[0, 0], -0.1 * k3[0, 1] * math.exp(-16.0) + 1.0]], dtype=DT))
    assert metrics["kl"] < 2
    unweighted, _ = kl_penalized_rewards(torch.tensor([1.0], dtype=DT), logprobs, ref, mask, 0.1, "k3")
    assert_close(rewards[0, 0], unweighted[0, 0])  # weight 1 changes nothing
