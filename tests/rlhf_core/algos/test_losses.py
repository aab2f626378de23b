import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rlhf_core.algos.losses import (
    AGG_MODES,
    aggregate_loss,
    bradley_terry_loss,
    ensemble_bradley_terry_loss,
    entropy_from_logits,
    explained_variance,
    grpo_policy_loss,
    logprobs_from_logits,
    loss_normalizer,
    ppo_policy_loss,
    truncated_is_weights,
    value_loss,
)

DT = torch.float64


def _batch(B=4, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=DT) * 3
    logprobs = (old + 0.3 * torch.randn(B, T, generator=g, dtype=DT)).requires_grad_()
    advantages = torch.randn(B, T, generator=g, dtype=DT)
    lengths = torch.tensor([T, 2, 5, 1])[:B]
    mask = torch.arange(T) < lengths[:, None]
    return logprobs, old, advantages, mask


# --- PPO policy loss ---------------------------------------------------------------------


def test_ppo_at_ratio_one_is_minus_mean_advantage():
    _, old, advantages, mask = _batch()
    logprobs = old.clone().requires_grad_()
    loss, metrics = ppo_policy_loss(logprobs, old, advantages, mask, clip_range=0.2)
    assert_close(loss, -advantages[mask].mean())
    assert metrics["clipfrac"] == 0.0 and metrics["approx_kl"] == 0.0 and metrics["ratio_mean"] == 1.0
    loss.backward()
    assert_close(logprobs.grad, -advantages * mask / mask.sum())  # d ratio / d logp = ratio = 1


@pytest.mark.parametrize(
    "advantage,ratio,clipped_ratio",
    [(2.0, 1.5, 1.2), (-3.0, 0.5, 0.8)],  # A > 0 above 1 + eps; A < 0 below 1 - eps
)
def test_ppo_clipped_regions_have_zero_gradient_and_the_clipped_value(advantage, ratio, clipped_ratio):
    old = torch.full((2, 3), -1.0, dtype=DT)
    logprobs = (old + math.log(ratio)).requires_grad_()
    advantages = torch.full((2, 3), advantage, dtype=DT)
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss, metrics = ppo_policy_loss(logprobs, old, advantages, mask, clip_range=0.2)
    assert_close(loss, torch.tensor(-advantage * clipped_ratio, dtype=DT))
    assert metrics["clipfrac"] == 1.0
    assert metrics["ratio_mean"] == pytest.approx(ratio)
    loss.backward()
    assert (logprobs.grad == 0).all()


@pytest.mark.parametrize("advantage,ratio", [(2.0, 0.5), (-3.0, 1.5)])
def test_ppo_pessimistic_side_is_not_clipped(advantage, ratio):
    # A > 0 with a low ratio (or A < 0 with a high one) keeps the unclipped, larger loss and its gradient.
    old = torch.full((1, 2), -1.0, dtype=DT)
    logprobs = (old + math.log(ratio)).requires_grad_()
    advantages = torch.full((1, 2), advantage, dtype=DT)
    loss, metrics = ppo_policy_loss(logprobs, old, advantages, torch.ones(1, 2), clip_range=0.2)
    assert_close(loss, torch.tensor(-advantage * ratio, dtype=DT))
    assert metrics["clipfrac"] == 0.0
    loss.backward()
    assert_close(logprobs.grad, torch.full((1, 2), -advantage * ratio / 2, dtype=DT))


def test_ppo_clip_higher():
    old = torch.zeros(1, 1, dtype=DT)
    logprobs = torch.full((1, 1), math.log(1.25), dtype=DT)
    adv = torch.ones(1, 1, dtype=DT)
    loss, _ = ppo_policy_loss(logprobs, old, adv, torch.ones(1, 1), clip_range=0.2)
    loss_high, _ = ppo_policy_loss(logprobs, old, adv, torch.ones(1, 1), clip_range=0.2, clip_range_high=0.28)
    assert_close(loss, torch.tensor(-1.2, dtype=DT))
    assert_close(loss_high, torch.tensor(-1.25, dtype=DT))


def test_ppo_approx_kl_is_k3_mean():
    logprobs, old, advantages, mask = _batch()
    _, metrics = ppo_policy_loss(logprobs, old, advantages, mask)
    log_ratio = (logprobs - old).detach()[mask]
    assert metrics["approx_kl"] == pytest.approx(((log_ratio.exp() - 1) - log_ratio).mean().item())


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("loss_fn", [ppo_policy_loss, grpo_policy_loss])
def test_policy_loss_masked_tokens_change_nothing(agg, loss_fn):
    logprobs, old, advantages, mask = _batch()
    loss, metrics = loss_fn(logprobs, old, advantages, mask, agg=agg)
    (grad,) = torch.autograd.grad(loss, logprobs)

    noise = 50 * torch.randn_like(old)
    noise[1, 3] = float("inf")
    bad_logprobs = torch.where(mask, logprobs.detach(), noise).requires_grad_()
    bad_loss, bad_metrics = loss_fn(
        bad_logprobs, torch.where(mask, old, -noise), torch.where(mask, advantages, noise), mask, agg=agg
    )
    (bad_grad,) = torch.autograd.grad(bad_loss, bad_logprobs)
    assert torch.equal(loss, bad_loss)
    assert torch.equal(grad, bad_grad)
    assert bad_metrics == metrics
    assert (bad_grad[~mask] == 0).all()


def test_aggregation_modes_hand_computed():
    advantages = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=DT)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    old = torch.zeros(2, 3, dtype=DT)
    expected = {
        "token-mean": -(1 + 2 + 3 + 4) / 4,
        "seq-mean-token-mean": -((1 + 2 + 3) / 3 + 4 / 1) / 2,
        "seq-mean-token-sum": -((1 + 2 + 3) + 4) / 2,
    }
    for agg, value in expected.items():
        loss, _ = ppo_policy_loss(old.clone(), old, advantages, mask, agg=agg)
        assert loss.item() == pytest.approx(value), agg


def test_unknown_aggregation_is_rejected():
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(torch.zeros(2, 2), torch.ones(2, 2), agg="mean")


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("loss_fn", [ppo_policy_loss, grpo_policy_loss])
def test_micro_batches_with_global_normalizer_give_the_full_batch_gradient(agg, loss_fn):
    logprobs, old, advantages, mask = _batch(B=4, T=6)  # 6 + 2 + 5 + 1 tokens: uneven halves
    full_loss, _ = loss_fn(logprobs, old, advantages, mask, agg=agg)
    (full_grad,) = torch.autograd.grad(full_loss, logprobs)

    normalizer = loss_normalizer(mask, agg)
    total, grad = 0.0, torch.zeros_like(old)
    for rows in (slice(0, 1), slice(1, 4)):
        micro = logprobs.detach()[rows].clone().requires_grad_()
        loss, _ = loss_fn(micro, old[rows], advantages[rows], mask[rows], agg=agg, normalizer=normalizer)
        loss.backward()  # gradient accumulation: plain sum, no division by the number of micro-batches
        total = total + loss.detach()
        grad[rows] = micro.grad
    assert_close(total, full_loss.detach())
    assert_close(grad, full_grad)


def test_micro_batches_without_normalizer_do_not_reproduce_token_mean():
    # Why the normalizer exists: averaging per-micro-batch token means over-weights short micro-batches.
    logprobs, old, advantages, mask = _batch()
    full, _ = ppo_policy_loss(logprobs, old, advantages, mask)
    parts = [ppo_policy_loss(logprobs[r], old[r], advantages[r], mask[r])[0] for r in (slice(0, 1), slice(1, 4))]
    assert not torch.allclose(sum(parts) / 2, full)


def test_loss_normalizer_counts():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert loss_normalizer(mask, "token-mean") == 3.0
    assert loss_normalizer(mask, "seq-mean-token-mean") == 3.0
    assert loss_normalizer(mask, "seq-mean-token-sum") == 3.0


# --- GRPO policy loss --------------------------------------------------------------------


def test_grpo_without_kl_is_ppo_with_sequence_mean():
    logprobs, old, advantages, mask = _batch()
    grpo, grpo_metrics = grpo_policy_loss(logprobs, old, advantages, mask)
    ppo, ppo_metrics = ppo_policy_loss(logprobs, old, advantages, mask, agg="seq-mean-token-mean")
    assert torch.equal(grpo, ppo)
    assert grpo_metrics == {**ppo_metrics, "kl_loss": 0.0}


def test_grpo_kl_term_hand_computed():
    old = torch.zeros(1, 2, dtype=DT)
    logprobs = torch.zeros(1, 2, dtype=DT, requires_grad=True)
    ref = torch.tensor([[math.log(2.0), 0.0]], dtype=DT)  # k3 = (2 - 1) - log 2 on token 0, 0 on token 1
    advantages = torch.tensor([[1.0, 1.0]], dtype=DT)
    loss, metrics = grpo_policy_loss(logprobs, old, advantages, torch.ones(1, 2), ref_logprobs=ref, kl_coef=0.5)
    k3 = 1.0 - math.log(2.0)
    assert loss.item() == pytest.approx(-1.0 + 0.5 * k3 / 2)
    assert metrics["kl_loss"] == pytest.approx(k3 / 2)
    loss.backward()
    # d k3 / d logp = 1 - r with r = exp(ref - logp): 1 - 2 = -1 on token 0, 0 on token 1
    assert_close(logprobs.grad, torch.tensor([[(-1.0 + 0.5 * -1.0) / 2, -1.0 / 2]], dtype=DT))


def test_grpo_kl_needs_reference():
    logprobs, old, advantages, mask = _batch()
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_policy_loss(logprobs, old, advantages, mask, kl_coef=0.1)


# --- value loss --------------------------------------------------------------------------


def _one(x):
    return torch.tensor([[x]], dtype=DT)


def test_value_loss_clipped_error_larger():
    values = _one(1.5).requires_grad_()
    loss, metrics = value_loss(values, old_values=_one(1.0), returns=_one(2.0), mask=torch.ones(1, 1), clip_range_value=0.2)
    # unclipped (1.5 - 2)^2 = 0.25; clipped V = 1.2, (1.2 - 2)^2 = 0.64 -> 0.5 * 0.64
    assert loss.item() == pytest.approx(0.32)
    assert metrics["vf_clipfrac"] == 1.0
    loss.backward()
    assert values.grad.item() == 0.0  # the clipped branch is constant in values


def test_value_loss_unclipped_error_larger():
    values = _one(1.5).requires_grad_()
    loss, metrics = value_loss(values, old_values=_one(1.0), returns=_one(1.0), mask=torch.ones(1, 1), clip_range_value=0.2)
    # unclipped 0.25; clipped (1.2 - 1)^2 = 0.04 -> 0.5 * 0.25
    assert loss.item() == pytest.approx(0.125)
    assert metrics["vf_clipfrac"] == 0.0
    loss.backward()
    assert values.grad.item() == pytest.approx(0.5)  # 0.5 * 2 * (1.5 - 1)


def test_value_loss_without_clipping_is_half_squared_error():
    g = torch.Generator().manual_seed(0)
    values, old, returns = (torch.randn(3, 4, generator=g, dtype=DT) for _ in range(3))
    mask = torch.arange(4) < torch.tensor([[4], [1], [3]])
    loss, metrics = value_loss(values, old, returns, mask, clip_range_value=None)
    assert_close(loss, 0.5 * ((values - returns) ** 2)[mask].mean())
    assert metrics["vf_clipfrac"] == 0.0


def test_value_loss_masked_tokens_change_nothing():
    g = torch.Generator().manual_seed(1)
    values, old, returns = (torch.randn(3, 4, generator=g, dtype=DT) for _ in range(3))
    mask = torch.arange(4) < torch.tensor([[4], [1], [3]])
    values.requires_grad_()
    loss, metrics = value_loss(values, old, returns, mask)
    (grad,) = torch.autograd.grad(loss, values)
    noise = torch.full_like(old, float("nan"))
    bad_values = torch.where(mask, values.detach(), noise).requires_grad_()
    bad_loss, bad_metrics = value_loss(bad_values, torch.where(mask, old, noise), torch.where(mask, returns, noise), mask)
    (bad_grad,) = torch.autograd.grad(bad_loss, bad_values)
    assert torch.equal(loss, bad_loss) and torch.equal(grad, bad_grad) and bad_metrics == metrics


def test_explained_variance_closed_forms():
    targets = torch.tensor([[1.0, 2.0, 3.0, 4.0, 99.0]], dtype=DT)
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    assert explained_variance(targets, targets, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(targets, 2.5), targets, mask) == pytest.approx(0.0)
    predictions = torch.tensor([[1.0, 2.0, 3.0, 5.0, 0.0]], dtype=DT)
    # residual (0, 0, 0, -1): var 0.1875; var(targets) = 1.25
    assert explained_variance(predictions, targets, mask) == pytest.approx(1 - 0.1875 / 1.25)
    assert math.isnan(explained_variance(predictions, torch.ones_like(targets), mask))


# --- Bradley-Terry -----------------------------------------------------------------------


def test_bradley_terry_hand_computed():
    loss, metrics = bradley_terry_loss(torch.tensor([2.0], dtype=DT), torch.tensor([0.0], dtype=DT))
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-2)))
    assert metrics == {"accuracy": 1.0, "reward_margin": 2.0, "chosen_reward": 2.0, "rejected_reward": 0.0}


def test_bradley_terry_margin_shifts_the_logit():
    r_c, r_r = torch.tensor([2.0, 0.5], dtype=DT), torch.tensor([0.0, 1.0], dtype=DT)
    loss, _ = bradley_terry_loss(r_c, r_r, margin=torch.tensor([1.0, 0.5], dtype=DT))
    expected = (math.log(1 + math.exp(-1.0)) + math.log(1 + math.exp(1.0))) / 2
    assert loss.item() == pytest.approx(expected)
    scalar, _ = bradley_terry_loss(r_c, r_r, margin=1.0)
    shifted, _ = bradley_terry_loss(r_c - 1.0, r_r)
    assert_close(scalar, shifted)


def test_bradley_terry_gradient_pushes_chosen_up_and_rejected_down():
    r_c = torch.tensor([0.3, -1.0, 2.0], dtype=DT, requires_grad=True)
    r_r = torch.tensor([0.1, 0.5, 2.0], dtype=DT, requires_grad=True)
    loss, metrics = bradley_terry_loss(r_c, r_r)
    loss.backward()
    assert (r_c.grad < 0).all() and (r_r.grad > 0).all()
    assert_close(r_c.grad, -torch.sigmoid(-(r_c - r_r)).detach() / 3)
    assert metrics["accuracy"] == pytest.approx(1 / 3)  # the tie counts as wrong


# --- logits helpers ----------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_logprobs_from_logits_matches_log_softmax_gather(chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = (5 * torch.randn(3, 5, 11, generator=g, dtype=DT)).requires_grad_()
    labels = torch.randint(0, 11, (3, 5), generator=g)
    out = logprobs_from_logits(logits, labels, chunk_size=chunk_size)
    ref = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    assert_close(out, ref)
    (grad,) = torch.autograd.grad(out.sum(), logits)
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    assert_close(grad, ref_grad)


def test_logprobs_from_half_precision_logits_come_out_float32():
    logits = torch.randn(2, 3, 50, dtype=DT)
    labels = torch.randint(0, 50, (2, 3))
    out = logprobs_from_logits(logits.to(torch.bfloat16), labels)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.to(torch.bfloat16).float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    assert_close(out, ref)


@pytest.mark.parametrize("chunk_size", [1, 1024])
def test_entropy_from_logits_matches_categorical(chunk_size):
    logits = 3 * torch.randn(2, 4, 9, dtype=DT)
    assert_close(entropy_from_logits(logits, chunk_size), torch.distributions.Categorical(logits=logits).entropy())
    uniform = torch.zeros(1, 1, 9, dtype=DT)
    assert_close(entropy_from_logits(uniform), torch.tensor([[math.log(9)]], dtype=DT))


def test_functional_logsigmoid_is_what_bradley_terry_uses():
    # guards against a switch to log(sigmoid(x)), which underflows for large negative margins
    loss, _ = bradley_terry_loss(torch.tensor([-200.0]), torch.tensor([0.0]))
    assert loss.item() == pytest.approx(-F.logsigmoid(torch.tensor(-200.0)).item())


# --- importance-weighted (decoupled) surrogate, for lagged samples ------------------------


def _clip_term(logprob, old, advantage, clip=0.2):
    ratio = torch.exp(logprob - old)
    return torch.maximum(-advantage * ratio, -advantage * torch.clamp(ratio, 1 - clip, 1 + clip))


def _decoupled_loop(logprobs, old, behaviour, advantages, mask, cap, agg, ref=None, kl_coef=0.0):
    """Slow reference, one token at a time (Hilton et al. 2022, eq. 4, plus GRPO's KL term):
    L_t = min(pi_old / mu, cap) * (clip surrogate_t + kl_coef * k3_t)."""
    per_seq, total, tokens = [], 0.0, 0
    for b in range(mask.shape[0]):
        seq, n = 0.0, 0
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                continue
            w = min(math.exp(old[b, t].item() - behaviour[b, t].item()), cap)
            term = _clip_term(logprobs[b, t], old[b, t], advantages[b, t])
            if kl_coef:
                log_r = ref[b, t] - logprobs[b, t]
                term = term + kl_coef * (torch.exp(log_r) - 1 - log_r)
            seq, n = seq + w * term, n + 1
        total, tokens = total + seq, tokens + n
        per_seq.append(seq / n if n else 0.0)
    return total / tokens if agg == "token-mean" else sum(per_seq) / len(per_seq)


def _lagged(seed=1):
    logprobs, old, advantages, mask = _batch()
    g = torch.Generator().manual_seed(seed)
    behaviour = old + 0.5 * torch.randn(old.shape, generator=g, dtype=DT)
    ref = old + 0.3 * torch.randn(old.shape, generator=g, dtype=DT)
    return logprobs, old, behaviour, ref, advantages, mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("cap", [1.0, 1.5, 100.0])
def test_importance_weighted_ppo_loss_and_gradient_match_the_loop_reference(agg, cap):
    logprobs, old, behaviour, _, advantages, mask = _lagged()
    weights, _ = truncated_is_weights(old, behaviour, mask, cap)
    loss, _ = ppo_policy_loss(logprobs, old, advantages, mask, agg=agg, is_weights=weights)
    (grad,) = torch.autograd.grad(loss, logprobs)
    ref_loss = _decoupled_loop(logprobs, old, behaviour, advantages, mask, cap, agg)
    (ref_grad,) = torch.autograd.grad(ref_loss, logprobs)
    assert_close(loss, ref_loss.reshape(()))
    assert_close(grad, ref_grad)


def test_importance_weights_also_weigh_the_grpo_kl_term():
    logprobs, old, behaviour, ref, advantages, mask = _lagged(seed=2)
    weights, _ = truncated_is_weights(old, behaviour, mask, cap=2.0)
    loss, metrics = grpo_policy_loss(logprobs, old, advantages, mask, ref_logprobs=ref, kl_coef=0.1, is_weights=weights)
    (grad,) = torch.autograd.grad(loss, logprobs)
    ref_loss = _decoupled_loop(logprobs, old, behaviour, advantages, mask, 2.0, "seq-mean-token-mean", ref, 0.1)
    (ref_grad,) = torch.autograd.grad(ref_loss, logprobs)
    assert_close(loss, ref_loss.reshape(()))
    assert_close(grad, ref_grad)
    assert metrics["kl_loss"] > 0


def test_a_token_the_sampler_liked_and_the_policy_dropped_does_not_blow_up_the_kl_gradient():
    # seen in a pipelined demo run: mu gave the token ~0.99, pi_old e^-16, ref ~0.96; the
    # unweighted k3 gradient (1 - ref / pi ~ -8.7e6) then dominated the whole update
    old = torch.tensor([[-16.0]], dtype=DT)
    logprobs = old.clone().requires_grad_()
    behaviour, ref = torch.tensor([[-0.009]], dtype=DT), torch.tensor([[-0.036]], dtype=DT)
    mask, advantages = torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, 1, dtype=DT)
    weights, _ = truncated_is_weights(old, behaviour, mask, cap=2.0)
    loss, _ = grpo_policy_loss(logprobs, old, advantages, mask, ref_logprobs=ref, kl_coef=0.1, is_weights=weights)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert abs(grad.item()) < 1.0
    plain, _ = grpo_policy_loss(logprobs, old, advantages, mask, ref_logprobs=ref, kl_coef=0.1)
    (plain_grad,) = torch.autograd.grad(plain, logprobs)
    assert abs(plain_grad.item()) > 1e5  # what the weights prevent


def test_unit_weights_change_nothing_and_constant_weights_scale_loss_and_gradient():
    logprobs, old, advantages, mask = _batch()
    plain, plain_metrics = grpo_policy_loss(logprobs, old, advantages, mask)
    (plain_grad,) = torch.autograd.grad(plain, logprobs)
    weights, metrics = truncated_is_weights(old, old.clone(), mask, cap=2.0)  # behaviour == old: no lag
    assert metrics == {"is_weight_mean": 1.0, "is_truncated_frac": 0.0, "is_log_ratio_abs": 0.0}
    same, same_metrics = grpo_policy_loss(logprobs, old, advantages, mask, is_weights=weights)
    assert torch.equal(same, plain) and same_metrics == plain_metrics
    scaled, _ = grpo_policy_loss(logprobs, old, advantages, mask, is_weights=torch.full_like(old, 0.25))
    (scaled_grad,) = torch.autograd.grad(scaled, logprobs)
    assert_close(scaled, 0.25 * plain)
    assert_close(scaled_grad, 0.25 * plain_grad)


def test_truncated_weights_closed_form():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]], dtype=DT))
    behaviour = torch.log(torch.tensor([[0.5, 0.25, 0.1, 0.9]], dtype=DT))  # ratios 1, 2, 5, 5/9
    mask = torch.tensor([[1, 1, 1, 0]])
    weights, metrics = truncated_is_weights(old, behaviour, mask, cap=3.0)
    assert_close(weights, torch.tensor([[1.0, 2.0, 3.0, 0.0]], dtype=DT))
    assert metrics["is_weight_mean"] == pytest.approx(2.0)
    assert metrics["is_truncated_frac"] == pytest.approx(1 / 3)
    assert metrics["is_log_ratio_abs"] == pytest.approx((0 + math.log(2) + math.log(5)) / 3)
    with pytest.raises(ValueError, match="cap must be >= 1"):
        truncated_is_weights(old, behaviour, mask, cap=0.5)


def test_weights_carry_no_gradient_and_padding_weights_are_ignored():
    logprobs, old, advantages, mask = _batch()
    weights = torch.rand(old.shape, dtype=DT, requires_grad=True)
    loss, _ = ppo_policy_loss(logprobs, old, advantages, mask, is_weights=weights)
    loss.backward()
    assert weights.grad is None
    garbage = weights.detach().masked_fill(~mask, float("inf"))
    again, _ = ppo_policy_loss(logprobs, old, advantages, mask, is_weights=garbage)
    assert_close(again, loss)


def _ensemble_bt_loop(r_c, r_r, w, margin):
    """Slow reference: member by member, pair by pair, in float64."""
    B, K = r_c.shape
    losses = []
    for k in range(K):
        num = den = 0.0
        for b in range(B):
            x = float(r_c[b, k]) - float(r_r[b, k]) - margin
            nll = math.log1p(math.exp(-x)) if x > 0 else -x + math.log1p(math.exp(x))
            num += float(w[b, k]) * nll
            den += float(w[b, k])
        losses.append(num / den if den > 0 else 0.0)
    return sum(losses) / K


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ensemble_bradley_terry_matches_a_loop(seed):
    g = torch.Generator().manual_seed(seed)
    r_c, r_r = torch.randn(9, 4, generator=g, dtype=DT), torch.randn(9, 4, generator=g, dtype=DT)
    w = torch.poisson(torch.ones(9, 4, dtype=DT), generator=g)
    w[:, 2] = 0.0  # a member that drew none of these pairs adds 0
    loss, _ = ensemble_bradley_terry_loss(r_c, r_r, w, margin=0.3)
    assert loss.item() == pytest.approx(_ensemble_bt_loop(r_c, r_r, w, 0.3), rel=1e-12)


def test_one_member_ensemble_is_bradley_terry_exactly():
    g = torch.Generator().manual_seed(0)
    r_c, r_r = torch.randn(16, generator=g), torch.randn(16, generator=g)
    single, m1 = bradley_terry_loss(r_c, r_r)
    ensemble, m2 = ensemble_bradley_terry_loss(r_c[:, None], r_r[:, None])
    assert torch.equal(single, ensemble) and m1 == m2


def test_ensemble_bradley_terry_weights_are_repeats():
    """A bootstrap weight of 2 is the pair seen twice (one member, so the member mean is exact)."""
    r_c, r_r = torch.tensor([[2.0], [0.5]], dtype=DT), torch.tensor([[0.0], [1.0]], dtype=DT)
    weighted, _ = ensemble_bradley_terry_loss(r_c, r_r, torch.tensor([[2.0], [1.0]], dtype=DT))
    repeated, _ = bradley_terry_loss(torch.tensor([2.0, 2.0, 0.5], dtype=DT), torch.tensor([0.0, 0.0, 1.0], dtype=DT))
    torch.testing.assert_close(weighted, repeated, rtol=1e-12, atol=0)


def test_ensemble_bradley_terry_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"\(B, K\)"):
        ensemble_bradley_terry_loss(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="weights"):
        ensemble_bradley_terry_loss(torch.zeros(3, 2), torch.zeros(3, 2), torch.ones(3, 1))
