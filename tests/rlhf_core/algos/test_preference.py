"""DPO / IPO / KTO against hand-computed cases, closed forms and per-example loop references."""
import math

import pytest
import torch
from torch.testing import assert_close

from rlhf_core.algos.preference import dpo_loss, kto_loss, kto_reference_point, sequence_logprobs

DT = torch.float64


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _pairs(B=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    pc, pr, rc, rr = (-torch.rand(B, generator=g, dtype=DT) * 8 for _ in range(4))
    return pc.requires_grad_(), pr.requires_grad_(), rc, rr


# --- sequence log-probs --------------------------------------------------------------------


def test_sequence_logprobs_sums_or_averages_the_response_tokens_only():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, float("-inf"), float("nan")]], dtype=DT)
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    assert sequence_logprobs(lp, mask).tolist() == [-5.0, -0.5]
    assert sequence_logprobs(lp, mask, average=True).tolist() == [-2.5, -0.5]


# --- DPO / IPO ------------------------------------------------------------------------------


def test_dpo_hand_computed_pair():
    # h = (-1 - -2) - (-3 - -2.5) = 1.5; beta 0.5 -> -log sigma(0.75)
    loss, m = dpo_loss(*(torch.tensor([v], dtype=DT) for v in (-1.0, -3.0, -2.0, -2.5)), beta=0.5)
    assert loss.item() == pytest.approx(-math.log(_sigmoid(0.75)), rel=1e-12)
    assert m["reward_chosen"] == pytest.approx(0.5) and m["reward_rejected"] == pytest.approx(-0.25)
    assert m["reward_margin"] == pytest.approx(0.75) and m["reward_accuracy"] == 1.0


def test_ipo_hand_computed_pair():
    # h = 1.5, beta 0.5 -> (1.5 - 1)^2
    loss, _ = dpo_loss(*(torch.tensor([v], dtype=DT) for v in (-1.0, -3.0, -2.0, -2.5)), beta=0.5, loss_type="ipo")
    assert loss.item() == pytest.approx(0.25, rel=1e-12)


@pytest.mark.parametrize("beta", [0.05, 0.1, 1.0])
def test_at_the_reference_dpo_costs_log_2_and_ipo_a_quarter_over_beta_squared(beta):
    pc, pr, _, _ = _pairs()
    assert dpo_loss(pc, pr, pc.detach(), pr.detach(), beta)[0].item() == pytest.approx(math.log(2))
    assert dpo_loss(pc, pr, pc.detach(), pr.detach(), beta, "ipo")[0].item() == pytest.approx(1 / (4 * beta**2))


def _dpo_loop(pc, pr, rc, rr, beta, loss_type, eps):
    total = 0.0
    for i in range(len(pc)):
        h = (pc[i] - rc[i]) - (pr[i] - rr[i])
        if loss_type == "ipo":
            total = total + (h - 1 / (2 * beta)) ** 2
        else:
            total = total - (1 - eps) * torch.log(torch.sigmoid(beta * h)) - eps * torch.log(torch.sigmoid(-beta * h))
    return total / len(pc)


@pytest.mark.parametrize("loss_type,eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
def test_dpo_matches_a_per_pair_loop_in_value_and_gradient(loss_type, eps):
    pc, pr, rc, rr = _pairs(seed=3)
    loss, _ = dpo_loss(pc, pr, rc, rr, 0.3, loss_type, eps)
    grads = torch.autograd.grad(loss, (pc, pr))
    ref = _dpo_loop(pc, pr, rc, rr, 0.3, loss_type, eps)
    ref_grads = torch.autograd.grad(ref, (pc, pr))
    assert_close(loss, ref)
    for g, r in zip(grads, ref_grads):
        assert_close(g, r)


def test_dpo_gradient_raises_the_chosen_and_lowers_the_rejected():
    pc, pr, rc, rr = _pairs(seed=1)
    loss, _ = dpo_loss(pc, pr, rc, rr, 0.1)
    g_chosen, g_rejected = torch.autograd.grad(loss, (pc, pr))
    assert (g_chosen < 0).all() and (g_rejected > 0).all()  # descent raises log pi(chosen)


def test_ipo_stops_pushing_at_the_target_margin():
    beta = 0.25
    target = 1 / (2 * beta)
    pc = torch.tensor([target], dtype=DT, requires_grad=True)
    loss, _ = dpo_loss(pc, torch.zeros(1, dtype=DT), torch.zeros(1, dtype=DT), torch.zeros(1, dtype=DT), beta, "ipo")
    (g,) = torch.autograd.grad(loss, pc)
    assert loss.item() == 0 and g.item() == 0


def test_dpo_rejects_an_unknown_loss_type_and_bad_smoothing():
    args = _pairs()
    with pytest.raises(ValueError, match="unknown DPO loss_type 'hinge'; valid: sigmoid, ipo"):
        dpo_loss(*args, loss_type="hinge")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*args, label_smoothing=0.5)


# --- KTO ------------------------------------------------------------------------------------


def test_kto_hand_computed_examples():
    # r = [1, -2], z0 = 0.5, beta 0.5: desirable 1 - sigma(0.25), undesirable 1 - sigma(0.5 * (0.5 + 2))
    policy = torch.tensor([-1.0, -4.0], dtype=DT)
    ref = torch.tensor([-2.0, -2.0], dtype=DT)
    loss, m = kto_loss(policy, ref, torch.tensor([True, False]), 0.5, beta=0.5, desirable_weight=1.0,
                       undesirable_weight=2.0)
    want = ((1 - _sigmoid(0.25)) + 2.0 * (1 - _sigmoid(1.25))) / 2
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert m["reward_desirable"] == pytest.approx(0.5) and m["reward_undesirable"] == pytest.approx(-1.0)
    assert m["reference_point"] == 0.5 and m["desirable_share"] == 0.5


def test_kto_at_the_reference_costs_half_the_weight():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(6, generator=g, dtype=DT) * 5
    labels = torch.tensor([1, 0, 1, 1, 0, 0]).bool()
    loss, _ = kto_loss(lp, lp, labels, 0.0, beta=0.2, desirable_weight=1.0, undesirable_weight=1.5)
    assert loss.item() == pytest.approx((3 * 0.5 + 3 * 0.75) / 6)


def test_kto_matches_a_per_example_loop_in_value_and_gradient():
    g = torch.Generator().manual_seed(5)
    policy = (-torch.rand(7, generator=g, dtype=DT) * 6).requires_grad_()
    ref = -torch.rand(7, generator=g, dtype=DT) * 6
    labels = torch.rand(7, generator=g) > 0.4
    z = torch.tensor(0.3, dtype=DT)
    loss, _ = kto_loss(policy, ref, labels, z, beta=0.4, desirable_weight=1.2, undesirable_weight=0.8)
    total = 0.0
    for i in range(7):
        r = policy[i] - ref[i]
        if labels[i]:
            total = total + 1.2 * (1 - torch.sigmoid(0.4 * (r - z)))
        else:
            total = total + 0.8 * (1 - torch.sigmoid(0.4 * (z - r)))
    ref_loss = total / 7
    assert_close(loss, ref_loss)
    assert_close(torch.autograd.grad(loss, policy)[0], torch.autograd.grad(ref_loss, policy)[0])


def test_kto_gradient_raises_desirable_and_lowers_undesirable():
    policy = torch.tensor([-3.0, -3.0], dtype=DT, requires_grad=True)
    loss, _ = kto_loss(policy, torch.full((2,), -3.0, dtype=DT), torch.tensor([True, False]), 0.0)
    g = torch.autograd.grad(loss, policy)[0]
    assert g[0] < 0 < g[1]


def test_kto_reference_point_is_the_clamped_detached_mean_log_ratio():
    policy = torch.tensor([-1.0, -2.0, -6.0], dtype=DT, requires_grad=True)
    ref = torch.tensor([-2.0, -2.0, -3.0], dtype=DT)
    z = kto_reference_point(policy, ref)  # mean(1, 0, -3) < 0 -> 0
    assert z.item() == 0 and not z.requires_grad
    assert kto_reference_point(policy, ref - 2).item() == pytest.approx(4 / 3)


def test_kto_metrics_of_a_batch_with_one_kind_only():
    _, m = kto_loss(torch.zeros(3, dtype=DT), torch.zeros(3, dtype=DT), torch.ones(3, dtype=torch.bool), 0.0)
    assert m["reward_desirable"] == 0 and math.isnan(m["reward_undesirable"])
