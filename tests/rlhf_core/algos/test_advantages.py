import pytest
import torch
from torch.testing import assert_close

from rlhf_core.algos.advantages import ADVANTAGE_ESTIMATORS, gae, grpo_advantages

DT = torch.float64


def gae_reference(rewards, values, mask, gamma, lam):
    """CleanRL's backwards loop, one sequence at a time over its valid tokens only."""
    advantages = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[b, t]]
        lastgaelam = 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            if k == len(steps) - 1:
                nextnonterminal, nextvalue = 0.0, 0.0
            else:
                nextnonterminal, nextvalue = 1.0, values[b, steps[k + 1]].item()
            delta = rewards[b, t].item() + gamma * nextvalue * nextnonterminal - values[b, t].item()
            lastgaelam = delta + gamma * lam * nextnonterminal * lastgaelam
            advantages[b, t] = lastgaelam
    returns = (advantages + values) * mask
    return advantages, returns


def _rollout(B=5, T=7, seed=0, holes=False):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g, dtype=DT)
    values = torch.randn(B, T, generator=g, dtype=DT)
    if holes:
        mask = torch.rand(B, T, generator=g) < 0.6
    else:
        lengths = torch.tensor([T, 1, 0, 3, 5])[:B]
        mask = torch.arange(T) < lengths[:, None]  # right padded, ragged, one empty row
    return rewards, values, mask


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
def test_gae_matches_per_sequence_loop(holes, gamma, lam):
    rewards, values, mask = _rollout(holes=holes, seed=int(gamma * 100 + lam * 10))
    adv, ret = gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = gae_reference(rewards, values, mask, gamma, lam)
    assert_close(adv, ref_adv)
    assert_close(ret, ref_ret)


def test_gae_lambda_zero_is_one_step_td():
    rewards, values, mask = _rollout()
    gamma = 0.9
    next_values = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros(values.shape[0], 1, dtype=DT)], 1)
    td = (rewards + gamma * next_values - values) * mask
    adv, _ = gae(rewards, values, mask, gamma, lam=0.0)
    assert_close(adv, td)


def test_gae_lambda_one_gamma_one_is_monte_carlo():
    rewards, values, mask = _rollout()
    rewards_to_go = (rewards * mask).flip(-1).cumsum(-1).flip(-1)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert_close(adv, (rewards_to_go - values) * mask)
    assert_close(ret, rewards_to_go * mask)


@pytest.mark.parametrize("holes", [False, True])
def test_gae_masked_tokens_change_nothing(holes):
    rewards, values, mask = _rollout(holes=holes)
    adv, ret = gae(rewards, values, mask, 0.99, 0.95)
    noise = torch.randn_like(rewards) * 100
    noise[0, 0] = float("inf")
    bad_rewards = torch.where(mask, rewards, noise)
    bad_values = torch.where(mask, values, -noise)
    adv2, ret2 = gae(bad_rewards, bad_values, mask, 0.99, 0.95)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_is_not_differentiated_through():
    rewards, values, mask = _rollout()
    adv, ret = gae(rewards, values.requires_grad_(), mask, 0.99, 0.95)
    assert not adv.requires_grad and not ret.requires_grad


def grpo_reference(scores, group_ids, scale_by_std, eps):
    out = torch.zeros_like(scores)
    for g in set(group_ids):
        idx = [i for i, gi in enumerate(group_ids) if gi == g]
        s = scores[idx]
        if len(idx) == 1:
            continue
        a = s - s.mean()
        out[idx] = a / (s.std() + eps) if scale_by_std else a
    return out


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_matches_loop(scale_by_std):
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(12, generator=g, dtype=DT)
    group_ids = [3, 1, 3, 7, 1, 3, 7, 1, 7, 3, 9, 1]  # shuffled, unequal sizes, a singleton
    adv = grpo_advantages(scores, group_ids, scale_by_std=scale_by_std, eps=1e-6)
    assert_close(adv, grpo_reference(scores, group_ids, scale_by_std, 1e-6))
    assert_close(grpo_advantages(scores, torch.tensor(group_ids), scale_by_std=scale_by_std), adv)


def test_grpo_group_size_equals_explicit_ids():
    scores = torch.randn(8, dtype=DT)
    assert_close(grpo_advantages(scores, group_size=4), grpo_advantages(scores, [0] * 4 + [1] * 4))
    assert_close(grpo_advantages(scores, group_size=4), grpo_advantages(scores, ["p"] * 4 + ["q"] * 4))


@pytest.mark.parametrize("value", [0.1, 0.7, 1.0 / 3.0, 1e6 + 0.7, -2.5])
@pytest.mark.parametrize("dtype", [torch.float32, DT])
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_equal_rewards_give_exactly_zero(value, dtype, scale_by_std):
    # sum/n of 7 copies of 0.1 is not 0.1 in float32; divided by (0 + eps) that residue
    # would become an advantage of ~0.01 for every response of an all-correct group.
    scores = torch.full((14,), value, dtype=dtype)
    adv = grpo_advantages(scores, group_size=7, scale_by_std=scale_by_std)
    assert torch.equal(adv, torch.zeros(14, dtype=dtype))


def test_grpo_std_scaling_gives_unit_std_per_group():
    scores = torch.randn(4, 8, dtype=DT) * torch.tensor([[0.01], [1.0], [10.0], [300.0]], dtype=DT)
    adv = grpo_advantages(scores.flatten(), group_size=8).view(4, 8)
    assert_close(adv.mean(-1), torch.zeros(4, dtype=DT), atol=1e-12, rtol=0)
    assert_close(adv.std(-1), torch.ones(4, dtype=DT), atol=1e-3, rtol=0)  # eps=1e-6 vs std 0.01


def test_grpo_without_std_only_centres():
    scores = torch.tensor([1.0, 2.0, 6.0, 10.0, 10.0, 40.0], dtype=DT)
    adv = grpo_advantages(scores, group_size=3, scale_by_std=False)
    assert_close(adv, torch.tensor([-2.0, -1.0, 3.0, -10.0, -10.0, 20.0], dtype=DT))


def test_grpo_rejects_bad_grouping():
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(5), group_size=2)
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(4))
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(4), group_ids=[0, 0, 1])


def test_registered_gae_is_gae():
    rewards, values, mask = _rollout()
    adv, ret = ADVANTAGE_ESTIMATORS["gae"](rewards, mask, values=values, gamma=0.9, lam=0.8)
    ref_adv, ref_ret = gae(rewards, values, mask, 0.9, 0.8)
    assert_close(adv, ref_adv)
    assert_close(ret, ref_ret)


@pytest.mark.parametrize("name,scale_by_std", [("grpo", True), ("grpo_no_std", False)])
def test_registered_grpo_broadcasts_sequence_advantage_to_valid_tokens(name, scale_by_std):
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]], dtype=torch.bool)
    token_rewards = torch.zeros(4, 3, dtype=DT)
    token_rewards[0, 1], token_rewards[1, 0], token_rewards[2, 2], token_rewards[3, 2] = 1.0, 3.0, 2.0, 5.0
    token_rewards[0, 2] = 100.0  # masked: not part of the score
    adv, ret = ADVANTAGE_ESTIMATORS[name](token_rewards, mask, group_ids=[0, 0, 1, 1])
    seq_adv = grpo_advantages(torch.tensor([1.0, 3.0, 2.0, 5.0], dtype=DT), group_size=2, scale_by_std=scale_by_std)
    assert_close(adv, seq_adv[:, None] * mask)
    assert torch.equal(ret, adv)


def test_registered_estimators_check_their_inputs():
    rewards, values, mask = _rollout()
    with pytest.raises(ValueError, match="values"):
        ADVANTAGE_ESTIMATORS["gae"](rewards, mask)
    with pytest.raises(ValueError, match="group_ids"):
        ADVANTAGE_ESTIMATORS["grpo"](rewards, mask)
