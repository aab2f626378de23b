"""The PPO / GRPO step on a tiny Llama with a plain torch optimizer: invariants and closed-form
directions, no Ray, DeepSpeed or vLLM."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import pytest
import torch

from rlhf_core.algos import gae, grpo_advantages, kl_k3, masked_whiten
from rlhf_core.config import ModelConfig, PolicyConfig
from rlhf_core.models.llama import build_policy
from rlhf_core.models.value import value_model_from_config
from rlhf_core.tokenizer import train_tokenizer
from rlhf_core.training.policy_step import (
    ALGORITHMS,
    PolicyBatch,
    StepOutcome,
    TorchBackwardAndStep,
    algorithm_spec,
    batched_logprobs,
    batched_values,
    build_batch,
    compute_advantages,
    guard_nonfinite,
    old_logprobs_from_update,
    policy_logprobs,
    prompt_indices,
    rollout_metrics,
    token_rewards,
    update_minibatches,
)

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2)


@dataclass(frozen=True)
class FakeRollout:
    group: int
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    logprobs: list[float]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([f"{a:02d}+{b:02d}={a + b:03d}" for a in range(30) for b in range(30)], vocab_size=64)


@pytest.fixture
def model(tok):
    torch.manual_seed(0)
    return build_policy(TINY, tok, seed=0)


def grpo_cfg(**kw) -> PolicyConfig:
    base = dict(algorithm="grpo", num_workers=1, prompts_per_step=2, grpo={"group_size": 2}, minibatch_size=4,
                micro_batch_size=2, epochs_per_step=1, kl_coef=0.0)
    return PolicyConfig(**{**base, **kw})


def ppo_cfg(**kw) -> PolicyConfig:
    base = dict(algorithm="ppo", num_workers=1, prompts_per_step=4, minibatch_size=4, micro_batch_size=2,
                epochs_per_step=1)
    return PolicyConfig(**{**base, **kw})


def rollouts(tok, responses: list[str], groups: list[int]) -> list[FakeRollout]:
    prompts = ["07+48=", "12+30=", "5+5=", "19+19="]
    out = []
    for i, (text, g) in enumerate(zip(responses, groups)):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append(FakeRollout(g, tok(prompts[i % len(prompts)])["input_ids"], ids, [-1.0] * len(ids)))
    return out


def filled(model, tok, responses, groups, scores, cfg, critic=None) -> PolicyBatch:
    """A batch through every phase up to the advantages, the reference being the model itself."""
    batch = build_batch(rollouts(tok, responses, groups), tok.pad_token_id)
    batch.old_logprobs = batched_logprobs(model, batch, cfg.temperature, chunk=3)
    batch.ref_logprobs = batch.old_logprobs.clone()
    if critic is not None:
        batch.values = batched_values(critic, batch, chunk=3)
    batch.scores = torch.tensor(scores, dtype=torch.float32)
    spec = algorithm_spec(cfg)
    rewards, _ = token_rewards(batch, spec, cfg.kl_coef, cfg.kl_estimator)
    batch.advantages, batch.returns = compute_advantages(batch, rewards, spec, cfg)
    return batch


def sgd_step(model, lr=0.1):
    return TorchBackwardAndStep(model.parameters(), torch.optim.SGD(model.parameters(), lr=lr), max_grad_norm=1e9)


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------- batch building


def test_build_batch_right_pads_and_points_at_the_predicting_columns(tok, model):
    rs = rollouts(tok, ["055", "42"], [0, 1])
    batch = build_batch(rs, tok.pad_token_id)
    assert batch.response_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    for b, r in enumerate(rs):
        p, n = len(r.prompt_token_ids), len(r.response_token_ids)
        assert batch.input_ids[b, p : p + n].tolist() == r.response_token_ids
        assert batch.attention_mask[b].sum() == p + n
        assert batch.positions[b, :n].tolist() == list(range(p - 1, p + n - 1))
    # logprobs gathered at those columns equal an unpadded one-row forward
    with torch.no_grad():
        got, _ = policy_logprobs(model.eval(), batch, temperature=0.7)
        for b, r in enumerate(rs):
            ids = torch.tensor([r.prompt_token_ids + r.response_token_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0] / 0.7, -1)
            want = torch.stack([logp[len(r.prompt_token_ids) - 1 + t, y] for t, y in enumerate(r.response_token_ids)])
            torch.testing.assert_close(got[b, : len(want)], want)


def test_prompt_indices_cover_every_prompt_once_per_epoch_and_depend_only_on_the_step():
    steps = [prompt_indices(10, 4, s, seed=3) for s in range(5)]  # 20 positions = 2 epochs
    stream = [i for s in steps for i in s]
    assert sorted(stream[:10]) == sorted(stream[10:]) == list(range(10))
    assert prompt_indices(10, 4, 3, seed=3) == steps[3]
    assert prompt_indices(10, 4, 0, seed=4) != steps[0]


def test_algorithms_are_data_not_branches():
    assert set(ALGORITHMS) == {"ppo", "grpo"}
    assert algorithm_spec(ppo_cfg()).advantage == "gae" and algorithm_spec(ppo_cfg()).uses_critic
    assert algorithm_spec(grpo_cfg()).advantage == "grpo" and not algorithm_spec(grpo_cfg()).kl_in_reward
    assert algorithm_spec(grpo_cfg(grpo={"group_size": 2, "scale_by_std": False})).advantage == "grpo_no_std"


# ----------------------------------------------------------------------------- rewards and advantages


def test_ppo_advantages_are_whitened_gae_over_kl_shaped_rewards(tok, model):
    cfg = ppo_cfg(kl_coef=0.1, kl_estimator="k1")
    critic = value_model_from_config(model.config)
    batch = filled(model, tok, ["055", "42", "1", "038"], [0, 1, 2, 3], [1.0, -1.0, 0.5, 0.0], cfg, critic)
    batch.ref_logprobs = batch.old_logprobs - 0.3  # k1 = 0.3 on every token
    rewards, metrics = token_rewards(batch, algorithm_spec(cfg), cfg.kl_coef, cfg.kl_estimator)
    mask = batch.response_mask
    last = mask.sum(-1).long() - 1
    expected = torch.where(mask.bool(), -0.03, 0.0)
    expected[torch.arange(4), last] += batch.scores
    torch.testing.assert_close(rewards, expected)
    assert metrics["kl"] == pytest.approx(0.3 * mask.sum().item() / 4)
    adv, ret = compute_advantages(batch, rewards, algorithm_spec(cfg), cfg)
    want_adv, want_ret = gae(rewards, batch.values, mask, cfg.ppo.gamma, cfg.ppo.lam)
    torch.testing.assert_close(adv, masked_whiten(want_adv, mask))
    torch.testing.assert_close(ret, want_ret)


def test_grpo_advantages_are_group_relative_outcomes_without_kl_in_the_reward(tok, model):
    cfg = grpo_cfg(kl_coef=0.5)
    batch = filled(model, tok, ["055", "056", "42", "4"], [0, 0, 1, 1], [1.0, 0.0, 0.0, 1.0], cfg)
    want = grpo_advantages(batch.scores, batch.group_ids)
    torch.testing.assert_close(batch.advantages, torch.where(batch.response_mask.bool(), want[:, None], 0.0))


def test_rollout_metrics_report_engine_gap_and_sequence_kl(tok, model):
    cfg = grpo_cfg()
    batch = filled(model, tok, ["055", "056", "42", "4"], [0, 0, 1, 1], [1.0, 0.0, 0.0, 1.0], cfg)
    batch.engine_logprobs = batch.old_logprobs + 0.01 * batch.response_mask
    batch.ref_logprobs = batch.old_logprobs - 0.2
    m = rollout_metrics(batch)
    assert m["logprob_diff"] == pytest.approx(0.01, rel=1e-4)
    token_p = batch.old_logprobs.exp()[batch.response_mask.bool()]  # |p e^0.01 - p| = p (e^0.01 - 1), averaged
    assert m["prob_diff"] == pytest.approx((token_p * (math.exp(0.01) - 1)).mean().item(), rel=1e-4)
    per_token = kl_k3(torch.tensor(0.0), torch.tensor(-0.2)).item()
    assert m["kl"] == pytest.approx(per_token * batch.response_mask.sum().item() / 4, rel=1e-5)
    assert m["response_length"] == batch.response_mask.sum().item() / 4


# ----------------------------------------------------------------------------- the update


def test_one_update_raises_the_logprob_of_positive_advantage_tokens(tok, model):
    # Closed form: at ratio 1 the PPO gradient is -A * grad log pi, so a small SGD step moves
    # log pi up where A > 0 and down where A < 0 (first order in the learning rate).
    cfg = grpo_cfg(minibatch_size=4, micro_batch_size=2)
    batch = filled(model, tok, ["055", "056", "42", "4"], [0, 0, 1, 1], [1.0, 0.0, 0.0, 1.0], cfg)
    signs = batch.advantages[:, 0].sign()
    assert signs.tolist() == [1, -1, -1, 1]
    before = batch.old_logprobs
    metrics = update_minibatches(model, batch, algorithm_spec(cfg), cfg, sgd_step(model, lr=0.05),
                                 minibatch_size=4, kl_coef=0.0)
    after = batched_logprobs(model, batch, cfg.temperature, chunk=4)
    seq_change = ((after - before) * batch.response_mask).sum(-1)
    assert (seq_change.sign() == signs).all(), seq_change
    assert metrics["nonfinite_skipped"] == 0 and metrics["clipfrac"] == 0.0
    assert metrics["approx_kl"] == pytest.approx(0.0, abs=1e-6)  # one step: ratio 1 on every micro-batch
    assert metrics["grad_norm"] > 0


def test_masked_tokens_change_nothing(tok, model):
    cfg = grpo_cfg()
    batch = filled(model, tok, ["055", "05", "42", "4"], [0, 0, 1, 1], [1.0, 0.0, 0.0, 1.0], cfg)
    pad = ~batch.response_mask.bool()
    assert pad.any()
    garbage = copy.deepcopy(batch)
    garbage.old_logprobs = torch.where(pad, float("inf"), batch.old_logprobs)
    garbage.advantages = torch.where(pad, 1e6, batch.advantages)
    garbage.ref_logprobs = torch.where(pad, float("nan"), batch.ref_logprobs)
    garbage.response_ids = torch.where(pad, 7, batch.response_ids)
    twin = copy.deepcopy(model)
    kw = dict(minibatch_size=4, kl_coef=0.1)
    m1 = update_minibatches(model, batch, algorithm_spec(cfg), cfg, sgd_step(model), **kw, generator=torch.Generator().manual_seed(0))
    m2 = update_minibatches(twin, garbage, algorithm_spec(cfg), cfg, sgd_step(twin), **kw, generator=torch.Generator().manual_seed(0))
    assert m1 == m2
    for name, w in weights(model).items():
        torch.testing.assert_close(weights(twin)[name], w, rtol=0, atol=0)


def test_nan_loss_skips_the_step_counts_it_and_leaves_weights_unchanged(tok, model):
    cfg = grpo_cfg(epochs_per_step=2, minibatch_size=2, micro_batch_size=1, grpo={"group_size": 2})
    batch = filled(model, tok, ["055", "056", "42", "4"], [0, 0, 1, 1], [1.0, 0.0, 0.0, 1.0], cfg)
    before = weights(model)
    inner = sgd_step(model)
    calls = []

    def nan_injected(loss, boundary):
        calls.append(boundary)
        return inner(loss + float("nan"), boundary)  # d(loss + nan)/d(loss) = 1: gradients stay finite

    metrics = update_minibatches(model, batch, algorithm_spec(cfg), cfg, nan_injected, minibatch_size=2, kl_coef=0.0)
    assert metrics["nonfinite_skipped"] == calls.count(True) == 4  # 2 epochs x 2 minibatches
    assert all(p.grad is None for p in model.parameters())
    for name, w in weights(model).items():
        torch.testing.assert_close(w, before[name], rtol=0, atol=0)


def test_guard_turns_a_nonfinite_loss_into_nan_gradients_everywhere(model):
    x = torch.ones(3, requires_grad=True)
    (guard_nonfinite((x * 2).sum() + float("inf"))).backward()
    assert torch.isnan(x.grad).all()
    y = torch.ones(3, requires_grad=True)
    guard_nonfinite((y * 2).sum()).backward()
    assert y.grad.tolist() == [2.0, 2.0, 2.0]


def test_nonfinite_loss_in_the_model_is_skipped_by_the_update(tok, model):
    cfg = grpo_cfg()
    batch = filled(model, tok, ["055", "056", "42", "4"], [0, 0, 1, 1], [1.0, 0.0, 0.0, 1.0], cfg)
    batch.old_logprobs = batch.old_logprobs.clone()
    batch.old_logprobs[0, 0] = float("-inf")  # a valid token: ratio = inf, loss = inf or NaN
    before = weights(model)
    metrics = update_minibatches(model, batch, algorithm_spec(cfg), cfg, sgd_step(model), minibatch_size=4, kl_coef=0.0)
    assert metrics["nonfinite_skipped"] == 1
    assert all(torch.equal(w, before[k]) for k, w in weights(model).items())


def test_grpo_with_equal_rewards_gives_zero_advantages_and_no_update(tok, model):
    cfg = grpo_cfg(kl_coef=0.1)  # policy == reference: the k3 gradient is 0 too
    batch = filled(model, tok, ["055", "056", "42", "4"], [0, 0, 1, 1], [0.7, 0.7, -2.0, -2.0], cfg)
    assert torch.equal(batch.advantages, torch.zeros_like(batch.advantages))
    before = weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    update_minibatches(model, batch, algorithm_spec(cfg), cfg, TorchBackwardAndStep(model.parameters(), opt, 1.0),
                       minibatch_size=4, kl_coef=cfg.kl_coef)
    for name, w in weights(model).items():
        torch.testing.assert_close(w, before[name], rtol=0, atol=0)


def test_ppo_update_trains_the_critic_toward_the_returns(tok, model):
    cfg = ppo_cfg(epochs_per_step=8, minibatch_size=4, micro_batch_size=2, kl_coef=0.0, ppo={"clip_range_value": None})
    critic = value_model_from_config(model.config)
    batch = filled(model, tok, ["055", "42", "1", "038"], [0, 1, 2, 3], [1.0, -1.0, 0.5, 0.0], cfg, critic)
    err_before = ((batch.values - batch.returns) ** 2 * batch.response_mask).sum()
    critic_opt = torch.optim.Adam(critic.parameters(), lr=3e-3)
    metrics = update_minibatches(
        model, batch, algorithm_spec(cfg), cfg, sgd_step(model, lr=1e-3), minibatch_size=4, kl_coef=0.0,
        critic=critic, critic_step=TorchBackwardAndStep(critic.parameters(), critic_opt, 1.0),
    )
    values = batched_values(critic, batch, chunk=4)
    err_after = ((values - batch.returns) ** 2 * batch.response_mask).sum()
    assert err_after < 0.5 * err_before
    assert {"value_loss", "vf_clipfrac", "critic_grad_norm", "critic_nonfinite_skipped"} <= set(metrics)
    with pytest.raises(ValueError, match="needs a critic"):
        update_minibatches(model, batch, algorithm_spec(cfg), cfg, sgd_step(model), minibatch_size=2, kl_coef=0.0)


def test_micro_batches_accumulate_to_the_full_minibatch_gradient(tok, model):
    # Loss normalised by the minibatch's token count in every micro-batch and summed: one
    # minibatch of 4 in micro-batches of 1 gives the same step as one micro-batch of 4.
    cfg1, cfg4 = grpo_cfg(micro_batch_size=1), grpo_cfg(micro_batch_size=4)
    batch = filled(model, tok, ["055", "05", "42", "4"], [0, 0, 1, 1], [1.0, 0.0, 0.0, 1.0], cfg1)
    twin = copy.deepcopy(model)
    update_minibatches(model, batch, algorithm_spec(cfg1), cfg1, sgd_step(model), minibatch_size=4, kl_coef=0.0)
    update_minibatches(twin, batch, algorithm_spec(cfg4), cfg4, sgd_step(twin), minibatch_size=4, kl_coef=0.0)
    for name, w in weights(model).items():
        torch.testing.assert_close(weights(twin)[name], w, rtol=1e-5, atol=1e-6)


def test_one_on_policy_update_takes_old_logprobs_from_its_own_forward(tok, model):
    # One epoch in one minibatch: pi_old is the policy being differentiated, so the update may
    # use its own forward's logprobs, detached, for pi_old. The step must equal the one that
    # computes them in a separate forward pass, and leave them in the batch for the metrics.
    cfg = grpo_cfg(kl_coef=0.1, micro_batch_size=2)  # 4 rows, minibatch 4: one optimizer step
    assert old_logprobs_from_update(algorithm_spec(cfg), cfg)
    batch = filled(model, tok, ["055", "05", "42", "4"], [0, 0, 1, 1], [1.0, 0.0, 0.0, 1.0], cfg)
    batch.ref_logprobs = batch.old_logprobs - 0.2  # a KL term in the loss, so its gradient is checked too
    separate = batch.old_logprobs.clone()
    shortcut = replace(batch, old_logprobs=None)
    twin, before = copy.deepcopy(model), weights(model)
    kw = dict(minibatch_size=4, kl_coef=cfg.kl_coef)
    m_sep = update_minibatches(model, batch, algorithm_spec(cfg), cfg, sgd_step(model), **kw,
                               generator=torch.Generator().manual_seed(0))
    m_own = update_minibatches(twin, shortcut, algorithm_spec(cfg), cfg, sgd_step(twin), **kw,
                               generator=torch.Generator().manual_seed(0))
    for name, w in weights(model).items():
        torch.testing.assert_close(weights(twin)[name], w, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(before[k], w) for k, w in weights(twin).items())  # the step did move the weights
    torch.testing.assert_close(shortcut.old_logprobs * batch.response_mask, separate * batch.response_mask,
                               rtol=1e-5, atol=1e-6)  # in row order, though the update shuffled them
    assert m_own["clipfrac"] == 0.0 and m_own["pg_loss"] == pytest.approx(m_sep["pg_loss"], abs=1e-5)


def test_old_logprobs_come_from_a_separate_forward_when_the_update_is_not_one_on_policy_step(tok, model):
    grpo = grpo_cfg()
    assert old_logprobs_from_update(algorithm_spec(grpo), grpo)
    for cfg in (grpo_cfg(epochs_per_step=2), grpo_cfg(minibatch_size=2),  # pi_old differs after the first step
                ppo_cfg(),  # the KL in PPO's reward needs pi_old before the update
                grpo_cfg(pipeline={"max_lag": 1})):  # the lag correction needs pi_old before the update
        assert not old_logprobs_from_update(algorithm_spec(cfg), cfg)
    cfg = grpo_cfg(epochs_per_step=2)
    batch = replace(filled(model, tok, ["055", "05", "42", "4"], [0, 0, 1, 1], [1.0, 0.0, 0.0, 1.0], cfg),
                    old_logprobs=None)
    with pytest.raises(ValueError, match="no old_logprobs.*2 pass"):
        update_minibatches(model, batch, algorithm_spec(cfg), cfg, sgd_step(model), minibatch_size=4, kl_coef=0.0)


def test_step_outcome_reports_grad_norm_before_clipping(model):
    x = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    step = TorchBackwardAndStep([x], torch.optim.SGD([x], lr=1.0), max_grad_norm=1.0)
    assert step((x**2).sum() / 2, boundary=False) is None
    out = step(torch.zeros((), requires_grad=True) + 0 * x.sum(), boundary=True)
    assert out == StepOutcome(True, 5.0)
    torch.testing.assert_close(x.detach(), torch.tensor([3.0 - 0.6, 4.0 - 0.8]))


def test_the_lm_head_runs_only_from_the_first_column_that_predicts_a_response_token(tok, model):
    """Prompts of different lengths: the head's output starts at the shortest prompt's last
    token, and the logprobs equal those of a forward that made every column's logits."""
    from rlhf_core.models.logits import keeps_logits

    rs = rollouts(tok, ["055", "42", "10"], [0, 1, 2])
    batch = build_batch(rs, tok.pad_token_id)
    shortest = min(len(r.prompt_token_ids) for r in rs)
    widths = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, out: widths.append(out.shape[1]))
    try:
        with torch.no_grad():
            got, _ = policy_logprobs(model.eval(), batch, temperature=0.7)
    finally:
        hook.remove()
    assert keeps_logits(model) and widths == [batch.input_ids.shape[1] - (shortest - 1)]
    assert widths[0] < batch.input_ids.shape[1]

    class AllLogits(torch.nn.Module):  # a forward without `logits_to_keep`: every column
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask)

    wrapped = AllLogits(model)
    assert not keeps_logits(wrapped)
    with torch.no_grad():
        full, _ = policy_logprobs(wrapped.eval(), batch, temperature=0.7)
    torch.testing.assert_close(got, full)


def test_keeps_logits_looks_through_lora_and_engine_wrappers(model):
    from peft import LoraConfig, get_peft_model

    from rlhf_core.models.logits import keeps_logits

    class Engine(torch.nn.Module):  # DeepSpeed's engine holds the model as `.module`
        def __init__(self, module):
            super().__init__()
            self.module = module

    import copy
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj"]))
    assert keeps_logits(Engine(lora))


def test_a_batch_moves_to_the_actors_device_whole(tok):
    """The worker builds the batch on the CPU and hands the actor `batch.to(actor.device)`:
    every tensor, the phases' later fields included, lands there (the meta device stands in
    for a GPU)."""
    batch = build_batch(rollouts(tok, ["055", "42"], [0, 1]), tok.pad_token_id)
    batch.old_logprobs = torch.zeros_like(batch.engine_logprobs)
    moved = batch.to("meta")
    tensors = {f: getattr(moved, f) for f in moved.__dataclass_fields__ if getattr(moved, f) is not None}
    assert len(tensors) == 8 and all(t.device.type == "meta" for t in tensors.values())
    assert moved.ref_logprobs is None and batch.input_ids.device.type == "cpu"  # a copy; None stays None


def test_frozen_models_sit_on_the_trainers_device_in_bf16_on_gpu_unchanged_on_cpu(model):
    import copy

    from rlhf_core.models.placement import frozen_dtype, frozen_on

    assert frozen_dtype("cuda:1") is torch.bfloat16 and frozen_dtype("cpu") is None
    on_cpu = frozen_on(copy.deepcopy(model).train(), "cpu")
    assert not on_cpu.training and not any(p.requires_grad for p in on_cpu.parameters())
    assert {p.dtype for p in on_cpu.parameters()} == {torch.float32}
    torch.testing.assert_close(on_cpu.state_dict(), model.state_dict())
    on_meta = frozen_on(copy.deepcopy(model), "meta")  # where a GPU would put it, without the cast
    assert {p.device.type for p in on_meta.parameters()} == {"meta"}
