"""The policy stage's precision: how auto decides, and what bf16 mixed precision computes."""
from __future__ import annotations

import pytest
import torch

from rlhf_core.config import ModelConfig, PolicyConfig
from rlhf_core.distributed.policy_rollouts import Sample
from rlhf_core.models.llama import build_policy
from rlhf_core.tokenizer import train_tokenizer
from rlhf_core.training.policy_step import PolicyBatch, build_batch, policy_logprobs
from rlhf_core.training.precision import MIN_SPEEDUP, computing_in, matmul_seconds, resolve_precision


def timings(fp32: float, bf16: float):
    """A measurement that says the same work took `fp32` seconds in fp32 and `bf16` in bf16."""
    return lambda dtype: {torch.float32: fp32, torch.bfloat16: bf16}[dtype]


@pytest.mark.parametrize(("fp32", "bf16", "chosen"), [
    (1.0, 0.5, "bf16"),                  # twice as fast
    (1.0, 1 / MIN_SPEEDUP, "bf16"),      # exactly the margin
    (1.0, 0.9, "fp32"),                  # faster, but within a shared machine's noise
    (1.0, 1.6, "fp32"),                  # slower: CPUs with AVX-512 bf16 and no AMX were measured so
])
def test_auto_takes_bf16_on_a_cpu_only_where_it_measures_clearly_faster(fp32, bf16, chosen):
    assert resolve_precision("auto", use_gpu=False, measure=timings(fp32, bf16)) == chosen


def test_an_explicit_precision_is_taken_as_it_is_and_an_unknown_one_refused():
    never = timings(float("nan"), float("nan"))
    assert resolve_precision("fp32", use_gpu=False, measure=never) == "fp32"
    assert resolve_precision("bf16", use_gpu=True, measure=never) == "bf16"
    with pytest.raises(ValueError, match="precision 'fp16': auto, fp32 or bf16"):
        resolve_precision("fp16", use_gpu=False)
    assert PolicyConfig().precision == "auto"
    with pytest.raises(ValueError, match="precision"):
        PolicyConfig(precision="fp16")
    with pytest.raises(ValueError, match="policy.precision bf16 is for ppo and grpo; dpo computes in fp32"):
        PolicyConfig(algorithm="dpo", precision="bf16")


def test_the_probe_times_real_matrix_multiplies():
    assert 0 < matmul_seconds(torch.float32, size=64, repeats=2) < 1


@pytest.fixture(scope="module")
def tiny():
    tok = train_tokenizer([f"{a:02d}+{b:02d}={a + b:03d}" for a in range(20) for b in range(20)], vocab_size=64)
    cfg = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2)
    model = build_policy(cfg, tok, seed=0)
    prompts = [tok(p)["input_ids"] for p in ("07+08=", "12+34=", "19+19=")]
    responses = [tok(r)["input_ids"][:3] for r in ("015", "046", "038")]
    samples = [Sample(0, "", p, r, "", [0.0] * len(r)) for p, r in zip(prompts, responses)]
    return model, samples, tok


def test_bf16_computes_the_matrix_multiplies_in_bf16_and_keeps_weights_and_gradients_fp32(tiny):
    model, samples, tok = tiny
    batch: PolicyBatch = build_batch(samples, tok.pad_token_id)
    model.zero_grad()
    with torch.no_grad():
        exact, _ = policy_logprobs(model, batch, temperature=1.0)
    with computing_in("bf16"):
        assert torch.nn.functional.linear(torch.ones(2, 4), torch.ones(3, 4)).dtype == torch.bfloat16
        logprobs, entropy = policy_logprobs(model, batch, temperature=1.0, with_entropy=True)
    assert logprobs.dtype == entropy.dtype == torch.float32  # softmax and the losses stay fp32
    assert not torch.equal(logprobs, exact)  # it did compute in bf16
    torch.testing.assert_close(logprobs, exact, atol=0.05, rtol=0)  # bf16 keeps 8 bits of mantissa
    (-(logprobs * batch.response_mask).sum()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with computing_in("fp32"):
        again, _ = policy_logprobs(model, batch, temperature=1.0)
    assert torch.equal(again.detach(), exact)
