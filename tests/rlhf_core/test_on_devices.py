"""The torch-level code of the GPU path, run on every device at hand: the step's phases, the
logits, the algorithms' math, the frozen models' placement and bf16 autocast.

Each test runs on the CPU and, marked `gpu`, on CUDA (tests/conftest.py skips those where
torch sees no CUDA device; `make gpu-check` runs this file on a GPU machine). The checks are
against slow references and closed forms, as in the CPU-only tests beside them; on CUDA they
also check that every tensor stays on the device. Only torch, transformers and the
pydantic config are imported: no Ray, DeepSpeed, vLLM, Prefect or MLflow.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields

import pytest
import torch

from rlhf_core.algos import aggregate_loss, gae, grpo_advantages, kl_k3, ppo_policy_loss
from rlhf_core.config import ModelConfig, PolicyConfig
from rlhf_core.models.llama import build_policy
from rlhf_core.models.logits import logits_from
from rlhf_core.models.placement import frozen_on
from rlhf_core.tokenizer import train_tokenizer
from rlhf_core.training.policy_step import (
    PolicyBatch,
    TorchBackwardAndStep,
    algorithm_spec,
    batched_logprobs,
    build_batch,
    compute_advantages,
    policy_logprobs,
    token_rewards,
    update_minibatches,
)
from rlhf_core.training.precision import computing_in

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2)
PROMPTS = ["07+48=", "12+30=", "5+5=", "19+19="]


@dataclass(frozen=True)
class FakeRollout:
    group: int
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    logprobs: list[float]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([f"{a:02d}+{b:02d}={a + b:03d}" for a in range(30) for b in range(30)], vocab_size=64)


@pytest.fixture
def model(tok, device):
    return build_policy(TINY, tok, seed=0).to(device)


def rollouts(tok, responses: list[str], groups: list[int]) -> list[FakeRollout]:
    out = []
    for i, (text, g) in enumerate(zip(responses, groups)):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append(FakeRollout(g, tok(PROMPTS[i % len(PROMPTS)])["input_ids"], ids, [-1.0] * len(ids)))
    return out


def grpo_cfg(**kw) -> PolicyConfig:
    base = dict(algorithm="grpo", num_workers=1, prompts_per_step=2, grpo={"group_size": 2}, minibatch_size=4,
                micro_batch_size=2, epochs_per_step=1, kl_coef=0.0)
    return PolicyConfig(**{**base, **kw})


def filled(model, tok, device, scores, cfg) -> PolicyBatch:
    """A batch on `device` through every phase up to the advantages (the reference is the model)."""
    batch = build_batch(rollouts(tok, ["055", "056", "42", "4"], [0, 0, 1, 1]), tok.pad_token_id).to(device)
    batch.old_logprobs = batched_logprobs(model, batch, cfg.temperature, chunk=3)
    batch.ref_logprobs = batch.old_logprobs.clone()
    batch.scores = torch.tensor(scores, device=device)
    spec = algorithm_spec(cfg)
    rewards, _ = token_rewards(batch, spec, cfg.kl_coef, cfg.kl_estimator)
    batch.advantages, batch.returns = compute_advantages(batch, rewards, spec, cfg)
    return batch


def on(device: str, *tensors: torch.Tensor) -> bool:
    return all(t.device.type == device for t in tensors)


# fp32 on CUDA: the batched and the one-row forward may pick different attention kernels
def tolerance(device: str) -> dict[str, float]:
    return {"rtol": 1e-4, "atol": 1e-4} if device == "cuda" else {}


# ----------------------------------------------------------------------------- the step's phases


def test_a_batch_moves_whole_to_the_device(tok, device):
    batch = build_batch(rollouts(tok, ["055", "42"], [0, 1]), tok.pad_token_id)
    batch.old_logprobs = torch.zeros_like(batch.engine_logprobs)
    moved = batch.to(device)
    tensors = [getattr(moved, f.name) for f in fields(moved) if getattr(moved, f.name) is not None]
    assert len(tensors) == 8 and on(device, *tensors)
    assert moved.ref_logprobs is None
    torch.testing.assert_close(moved.input_ids.cpu(), batch.input_ids, rtol=0, atol=0)


def test_policy_logprobs_on_the_device_equal_a_one_row_forward(tok, model, device):
    rs = rollouts(tok, ["055", "42", "1"], [0, 1, 2])
    batch = build_batch(rs, tok.pad_token_id).to(device)
    with torch.no_grad():
        got, entropy = policy_logprobs(model.eval(), batch, temperature=0.7, with_entropy=True)
        assert on(device, got, entropy) and got.dtype == torch.float32
        for b, r in enumerate(rs):
            ids = torch.tensor([r.prompt_token_ids + r.response_token_ids], device=device)
            logp = torch.log_softmax(model(input_ids=ids).logits[0] / 0.7, -1)
            want = torch.stack([logp[len(r.prompt_token_ids) - 1 + t, y] for t, y in enumerate(r.response_token_ids)])
            torch.testing.assert_close(got[b, : len(want)], want, **tolerance(device))


def test_logits_from_a_column_equal_the_full_forwards_columns(tok, model, device):
    batch = build_batch(rollouts(tok, ["055", "42"], [0, 1]), tok.pad_token_id).to(device)
    first = int(batch.positions.min())
    with torch.no_grad():
        logits, offset = logits_from(model.eval(), batch.input_ids, batch.attention_mask, first)
        full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # (B, L, V)
    assert offset == first and logits.shape == (2, batch.input_ids.shape[1] - first, len(tok))
    assert on(device, logits)
    torch.testing.assert_close(logits, full[:, first:], **tolerance(device))


def test_one_sgd_update_on_the_device_raises_the_logprob_of_positive_advantage_tokens(tok, model, device):
    # Closed form: at ratio 1 the GRPO gradient is -A * grad log pi, so a small SGD step moves
    # each sequence's log pi up where A > 0 and down where A < 0 (first order in the learning rate).
    cfg = grpo_cfg()
    batch = filled(model, tok, device, [1.0, 0.0, 0.0, 1.0], cfg)
    signs = batch.advantages[:, 0].sign()
    assert signs.tolist() == [1, -1, -1, 1] and on(device, batch.advantages, batch.returns)
    step = TorchBackwardAndStep(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.05), max_grad_norm=1e9)
    metrics = update_minibatches(model, batch, algorithm_spec(cfg), cfg, step, minibatch_size=4, kl_coef=0.0)
    after = batched_logprobs(model, batch, cfg.temperature, chunk=4)
    seq_change = ((after - batch.old_logprobs) * batch.response_mask).sum(-1)
    assert (seq_change.sign() == signs).all(), seq_change
    assert metrics["nonfinite_skipped"] == 0 and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0


def test_one_adamw_update_on_the_device_raises_the_objective_and_keeps_its_state_there(tok, model, device):
    # Adam's first step is -lr * sign(grad) per weight, so to first order the loss falls by
    # lr * |grad|_1: the surrogate -A * log pi, aggregated as the loss is, falls (ratio 1, no clip,
    # no KL gradient while the policy is its reference).
    cfg = grpo_cfg(kl_coef=0.1)
    batch = filled(model, tok, device, [1.0, 0.0, 0.0, 1.0], cfg)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=device == "cuda")
    step = TorchBackwardAndStep(model.parameters(), opt, max_grad_norm=1.0)
    metrics = update_minibatches(model, batch, algorithm_spec(cfg), cfg, step, minibatch_size=4, kl_coef=cfg.kl_coef)
    after = batched_logprobs(model, batch, cfg.temperature, chunk=4)

    def surrogate(logprobs):
        return aggregate_loss(-batch.advantages * logprobs, batch.response_mask, cfg.loss_agg).item()

    assert surrogate(after) < surrogate(batch.old_logprobs)
    assert metrics["nonfinite_skipped"] == 0 and metrics["clipfrac"] == 0.0
    assert any(not torch.equal(before[k], w) for k, w in model.state_dict().items())
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    assert state and on(device, *state, *model.parameters())
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none) at the boundary


# ----------------------------------------------------------------------------- the algorithms' math


def test_grpo_advantages_on_the_device_are_the_groups_standardised_scores(device):
    scores = torch.tensor([1.0, 0.0, 3.0, 3.0, 2.0, 4.0], device=device)
    adv = grpo_advantages(scores, torch.tensor([0, 0, 1, 1, 2, 2], device=device))
    # groups (1, 0) and (2, 4): +-half the gap over the unbiased std gap / sqrt(2); equal scores: 0
    r = 1 / math.sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([r, -r, 0.0, 0.0, -r, r], device=device), rtol=1e-5, atol=1e-5)
    assert on(device, adv)


def test_gae_with_gamma_and_lambda_one_and_no_critic_is_the_reward_to_go(device):
    rewards = torch.tensor([[0.0, 1.0, 2.0, 9.0], [3.0, 0.0, 1.0, 0.0]], device=device)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]], device=device)
    adv, ret = gae(rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=1.0)
    want = torch.tensor([[3.0, 3.0, 2.0, 0.0], [4.0, 1.0, 1.0, 0.0]], device=device)  # masked reward 9 ignored
    torch.testing.assert_close(adv, want)
    torch.testing.assert_close(ret, want)
    assert on(device, adv, ret)


def test_k3_is_zero_on_the_reference_and_its_closed_form_off_it(device):
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], device=device)
    torch.testing.assert_close(kl_k3(logprobs, logprobs), torch.zeros_like(logprobs))
    k3 = kl_k3(logprobs, logprobs - 0.2)  # log r = -0.2
    torch.testing.assert_close(k3, torch.full_like(logprobs, math.exp(-0.2) - 1 + 0.2))
    assert on(device, k3) and (k3 > 0).all()


def test_ppo_loss_at_ratio_one_is_minus_the_mean_advantage_and_the_clip_stops_the_gradient(device):
    advantages = torch.tensor([[1.0, -2.0, 0.5], [3.0, 1.0, 7.0]], device=device)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], device=device)
    old = torch.full_like(advantages, -1.0)
    logprobs = old.clone().requires_grad_(True)
    loss, metrics = ppo_policy_loss(logprobs, old, advantages, mask, clip_range=0.2)
    assert loss.item() == pytest.approx(-(1.0 - 2.0 + 0.5 + 3.0 + 1.0) / 5)
    assert metrics["clipfrac"] == 0.0 and metrics["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    # ratio e^0.5 > 1.2 with A > 0: the clipped term is active, no gradient
    pushed = (old + 0.5).requires_grad_(True)
    loss, metrics = ppo_policy_loss(pushed, old, advantages.abs(), mask, clip_range=0.2)
    loss.backward()
    assert metrics["clipfrac"] == 1.0 and on(device, loss, pushed.grad)
    assert torch.count_nonzero(pushed.grad) == 0


# ----------------------------------------------------------------------------- placement and precision


def test_the_held_out_passes_compute_on_the_models_device(tok, model, device, tmp_path):
    """Greedy answers and the sampled KL (the DPO/KTO stage's held-out pass, the gates'
    accuracy), the gates' exact KL and the reward model's pair scores take their inputs to the
    model's device."""
    from rlhf_core.data.pairs import tokenize_pairs
    from rlhf_core.eval.sampled_kl import exact_kl, sampled_kl
    from rlhf_core.eval.accuracy import greedy_completions
    from rlhf_core.models.llama import save_pretrained_atomic
    from rlhf_core.models.reward import reward_model_from_base, score_pairs_members

    on_device = copy.deepcopy(model).to(device)
    answers = greedy_completions(on_device, tok, PROMPTS, max_new_tokens=4)
    assert answers == greedy_completions(model, tok, PROMPTS, max_new_tokens=4)
    assert sampled_kl(on_device, on_device, tok, PROMPTS, max_new_tokens=4, temperature=1.0, seed=0) == pytest.approx(
        0.0, abs=1e-5)
    # the gates' KL: answers drawn on the device, and the same draw for the same seed
    other = copy.deepcopy(on_device)
    with torch.no_grad():
        other.lm_head.weight.mul_(1.5)
    kl = exact_kl(other, on_device, tok, PROMPTS, max_new_tokens=4, temperature=1.0, seed=0)
    assert kl > 0 and kl == exact_kl(other, on_device, tok, PROMPTS, max_new_tokens=4, temperature=1.0, seed=0)
    assert exact_kl(on_device, on_device, tok, PROMPTS, max_new_tokens=4, temperature=1.0, seed=0) == pytest.approx(
        0.0, abs=1e-5)
    scorer = reward_model_from_base(save_pretrained_atomic(model, tok, tmp_path / "policy")).to(device)
    pairs = tokenize_pairs([{"prompt": p, "chosen": "1", "rejected": "2"} for p in PROMPTS], tok, max_length=16)
    chosen, rejected = score_pairs_members(scorer, pairs)
    assert chosen.shape == rejected.shape == (1, len(PROMPTS)) and chosen.device.type == "cpu"


def test_frozen_models_are_bf16_on_cuda_and_unchanged_on_the_cpu(model, device):
    frozen = frozen_on(copy.deepcopy(model).train(), device)
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    assert on(device, *frozen.parameters())
    want = torch.bfloat16 if device == "cuda" else torch.float32
    assert {p.dtype for p in frozen.parameters()} == {want}
    tol = {"rtol": 1e-2, "atol": 1e-2} if device == "cuda" else {"rtol": 0, "atol": 0}
    for name, w in frozen.state_dict().items():
        torch.testing.assert_close(w.float(), model.state_dict()[name], **tol)


def test_bf16_autocast_multiplies_in_bf16_and_keeps_weights_logprobs_and_gradients_fp32(tok, model, device):
    batch = build_batch(rollouts(tok, ["055", "42", "1"], [0, 1, 2]), tok.pad_token_id).to(device)
    with torch.no_grad():
        fp32, _ = policy_logprobs(model.eval(), batch, temperature=1.0)
    with computing_in("bf16", device):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        bf16, _ = policy_logprobs(model.train(), batch, temperature=1.0)
    assert logits.dtype == torch.bfloat16 and bf16.dtype == torch.float32 and on(device, bf16)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(bf16[mask].detach(), fp32[mask], rtol=0, atol=0.1)  # bf16: ~3 significant digits
    (-(bf16 * batch.response_mask).sum()).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    assert {p.dtype for p in model.parameters()} == {torch.float32} and on(device, *grads)


# ----------------------------------------------------------------------------- weight sync by CUDA IPC

IPC_READER = """
import pickle, sys
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
args, offsets = pickle.load(sys.stdin.buffer)
args = list(args)
args[6] = 0  # the receiver's device index, as vLLM's IPC engine overwrites it
buffer = rebuild_cuda_tensor(*args)
parts = [buffer[start:end].clone().float().cpu() for start, end in offsets]
del buffer  # let go of the mapping, as vLLM's consumer does once it has cloned a chunk
torch.cuda.synchronize()
pickle.dump([p.tolist() for p in parts], sys.stdout.buffer)
"""


@pytest.mark.gpu
def test_a_packed_bf16_buffer_shared_by_its_cuda_ipc_handle_reads_back_whole_in_another_process():
    """What the colocated engine's weight sync rests on (rlhf_core/rollout/ipc_transfer.py, vLLM's
    packed IPC mode): tensors copied into one bf16 staging buffer, exported with torch's
    `reduce_tensor`, rebuilt in another process with the device index at argument 6 replaced,
    and sliced back by offsets. Run with torch alone, in a process of its own."""
    import pickle
    import subprocess
    import sys

    from torch.multiprocessing.reductions import reduce_tensor

    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(37, 11, generator=gen), torch.randn(5, generator=gen), torch.randn(64, 3, generator=gen)]
    allocated = torch.cuda.memory_allocated()
    buffer = torch.empty(sum(t.numel() for t in tensors), dtype=torch.bfloat16, device="cuda")
    offsets, start = [], 0
    for t in tensors:
        buffer[start:start + t.numel()].copy_(t.flatten())
        offsets.append((start, start + t.numel()))
        start += t.numel()
    torch.cuda.synchronize()
    _, args = reduce_tensor(buffer)
    assert isinstance(args[6], int) and args[6] == buffer.device.index  # the argument vLLM overwrites
    read = subprocess.run([sys.executable, "-c", IPC_READER], input=pickle.dumps((args, offsets)), capture_output=True,
                          timeout=120)
    assert read.returncode == 0, read.stderr.decode()[-2000:]
    for got, t in zip(pickle.loads(read.stdout), tensors):
        assert got == t.flatten().to(torch.bfloat16).float().tolist()
    del buffer
    torch.cuda.ipc_collect()
    # The reader let go of its mapping, so the exporter's buffer is freed rather than parked in
    # torch's limbo of IPC-shared blocks: what the sync's `ipc_collect` after each chunk relies on.
    assert torch.cuda.memory_allocated() == allocated, "the IPC-shared buffer was not freed after the reader let go"
