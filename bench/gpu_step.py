"""One GRPO step on a device, timed and measured phase by phase, through the project's own step
code (`rlhf_core.training.policy_step`) in the policy worker's order: what `bench/gpu_check.py`
runs on a GPU (and, in a dry run, on the CPU), under plain torch and under DeepSpeed alike.

Rollouts come from Hugging Face `generate` (sampling, a group of answers per prompt; the rollout
engine, vLLM, is not on a GPU check's machine) and are scored by a dummy verifiable reward, the
share of even token ids in the answer: there is no reward model. Needs torch, transformers and
rlhf_core's configs (pydantic) alone.
"""
from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_core.config import CircuitBreakerConfig, PolicyConfig, RolloutEngineConfig
from rlhf_core.models.memory import GpuPolicyShape, gpu_policy_bytes
from rlhf_core.training.policy_step import (
    BackwardAndStep, PolicyBatch, algorithm_spec, batched_logprobs, build_batch, compute_advantages,
    old_logprobs_from_update, rollout_metrics, teacher_forced, token_rewards, update_minibatches,
)
from rlhf_core.rollout.factory import engine_settings
from rlhf_core.rollout.sync_check import PROBE_ROWS, Probe, probe_of, verdict
from rlhf_core.training.circuit_breaker import prob_diff_bound
from rlhf_core.training.precision import computing_in

PAD, BOS, EOS = 0, 1, 2


@dataclass(frozen=True)
class Plan:
    """What one check runs: the model's shape and one step's batch."""

    name: str
    model: dict  # LlamaConfig keywords
    prompts: int
    group: int  # answers sampled per prompt
    prompt_tokens: tuple[int, int]  # prompt lengths drawn from [lo, hi]
    new_tokens: int
    minibatch: int  # rows per optimizer step
    micro_batch: int  # rows per forward and backward
    steps: int

    def describe(self) -> str:
        m = self.model
        return (f"Llama of {self.name} (hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, "
                f"{m['num_attention_heads']} heads, {m['num_key_value_heads']} KV heads, intermediate "
                f"{m['intermediate_size']}, vocab {m['vocab_size']}; {parameter_count(self) / 1e6:,.1f}M parameters); "
                f"{self.prompts} prompts x {self.group} answers, prompts of {self.prompt_tokens[0]}-"
                f"{self.prompt_tokens[1]} tokens, up to {self.new_tokens} new tokens, minibatch {self.minibatch}, "
                f"micro-batch {self.micro_batch}, {self.steps} step(s)")


# Qwen2.5-0.5B's shape (tied embeddings) as a Llama, its 151,936-token vocabulary cut to 32,000
GPU_PLAN = Plan("Qwen2.5-0.5B's shape", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                             num_attention_heads=14, num_key_value_heads=2, vocab_size=32000),
                prompts=16, group=8, prompt_tokens=(64, 128), new_tokens=256, minibatch=64, micro_batch=16, steps=2)
DRY_PLAN = Plan("a tiny shape", dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=1024),
                prompts=2, group=4, prompt_tokens=(8, 16), new_tokens=16, minibatch=4, micro_batch=4, steps=1)


@dataclass(frozen=True)
class Rollout:
    group: int
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    logprobs: list[float]


def llama_config(plan: Plan) -> LlamaConfig:
    return LlamaConfig(**plan.model, max_position_embeddings=2048, tie_word_embeddings=True,
                       bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)


def parameter_count(plan: Plan) -> int:
    with torch.device("meta"):  # shapes only: nothing is allocated
        return sum(p.numel() for p in LlamaForCausalLM(llama_config(plan)).parameters())


def policy_config(plan: Plan, precision: str) -> PolicyConfig:
    return PolicyConfig(algorithm="grpo", num_workers=1, prompts_per_step=plan.prompts, grpo={"group_size": plan.group},
                        minibatch_size=plan.minibatch, micro_batch_size=plan.micro_batch, epochs_per_step=1,
                        max_new_tokens=plan.new_tokens, temperature=1.0, precision=precision)


def random_prompts(plan: Plan, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lo, hi = plan.prompt_tokens
    lengths = torch.randint(lo, hi + 1, (plan.prompts,), generator=g).tolist()
    vocab = plan.model["vocab_size"]
    return [[BOS, *torch.randint(3, vocab, (n - 1,), generator=g).tolist()] for n in lengths]


@torch.no_grad()
def generate(actor, prompts: list[list[int]], plan: Plan, cfg: PolicyConfig, precision: str) -> list[Rollout]:
    """`plan.group` sampled answers per prompt from HF generate, cut after EOS, with the sampler's
    logprobs of their tokens (the engine logprobs of a rollout)."""
    device = actor.device
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padded: generation continues every row at its end
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with computing_in(precision, device):
        out = actor.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                             temperature=cfg.temperature, top_k=0, top_p=1.0, max_new_tokens=cfg.max_new_tokens,
                             num_return_sequences=plan.group, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=PAD, eos_token_id=EOS)
    new = out.sequences[:, width:]  # (P * G, N), each prompt's G answers side by side
    logprobs = torch.stack([torch.log_softmax(s.float(), -1).gather(-1, new[:, t, None]).squeeze(-1)
                            for t, s in enumerate(out.scores)], dim=1)  # (P * G, N)
    rollouts = []
    for b, (tokens, lps) in enumerate(zip(new.tolist(), logprobs.tolist())):
        n = tokens.index(EOS) + 1 if EOS in tokens else len(tokens)
        rollouts.append(Rollout(b // plan.group, prompts[b // plan.group], tokens[:n], lps[:n]))
    return rollouts


def dummy_scores(rollouts: list[Rollout]) -> torch.Tensor:
    """A verifiable stand-in for a reward: the share of even token ids in each answer. (B,)"""
    return torch.tensor([sum(t % 2 == 0 for t in r.response_token_ids) / max(1, len(r.response_token_ids))
                         for r in rollouts])


@contextmanager
def phase(record: dict, name: str, device: torch.device) -> Iterator[None]:
    """Time a phase (the GPU's queue drained on both sides) and its peak GPU memory."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    yield
    if cuda:
        torch.cuda.synchronize(device)
        record["peak_gib"][name] = torch.cuda.max_memory_allocated(device) / 2**30
        free, total = torch.cuda.mem_get_info(device)  # the device's view: CUDA context and allocator cache too
        record["in_use_gib"][name] = (total - free) / 2**30
    record["seconds"][name] = time.perf_counter() - start


def grpo_step(actor, reference, stepper: BackwardAndStep, prompts, plan: Plan, cfg: PolicyConfig, precision: str,
              step: int, check: Callable[[PolicyBatch, dict, dict], list[str]]) -> dict:
    """One GRPO step through `rlhf_core.training.policy_step`, in the policy worker's order; the
    update's backward and optimizer step by `stepper`; `check(batch, metrics, weights before)`
    names what does not hold after it."""
    device, spec = actor.device, algorithm_spec(cfg)
    record: dict = {"seconds": {}, "peak_gib": {}, "in_use_gib": {}}
    start = time.perf_counter()
    with phase(record, "generate", device):
        rollouts = generate(actor, prompts, plan, cfg, precision)
    with phase(record, "score", device):
        batch = build_batch(rollouts, PAD).to(device)
        batch.scores = dummy_scores(rollouts).to(device)
    with phase(record, "logprobs", device), computing_in(precision, device):
        if not old_logprobs_from_update(spec, cfg):
            batch.old_logprobs = batched_logprobs(actor, batch, cfg.temperature, cfg.micro_batch_size)
        batch.ref_logprobs = batched_logprobs(reference, batch, cfg.temperature, cfg.micro_batch_size)
    with phase(record, "advantages", device):
        rewards, _ = token_rewards(batch, spec, cfg.kl_coef, cfg.kl_estimator)
        batch.advantages, batch.returns = compute_advantages(batch, rewards, spec, cfg)
    before = {name: w.detach().clone() for name, w in watched_weights(actor).items()}
    probe = probe_of(rollouts)
    stale = engine_copy(actor, precision)  # the engine as it sampled: what a sync that did nothing leaves
    said_before = (said(stale, probe, None), said(actor, probe, precision))
    with phase(record, "update", device), computing_in(precision, device):
        update = update_minibatches(actor, batch, spec, cfg, stepper, minibatch_size=cfg.minibatch_size,
                                    kl_coef=cfg.kl_coef, generator=torch.Generator().manual_seed(step))
    with phase(record, "sync", device):
        sync = sync_checks(actor, stale, probe, precision, said_before)
    total = time.perf_counter() - start
    generated = int(batch.response_mask.sum())
    metrics = {**rollout_metrics(batch), **update, "score_mean": batch.scores.mean().item(), "sync_gap": sync["gap"]}
    return {"step": step, "seconds": {**record["seconds"], "total": total},
            "peak_gpu_memory_gib": record["peak_gib"] or None, "gpu_memory_in_use_gib": record["in_use_gib"] or None,
            "generated_tokens": generated, "generated_tokens_per_s": generated / record["seconds"]["generate"],
            "metrics": metrics, "failed_checks": check(batch, metrics, before) + sync["failed"]}


def engine_copy(actor, precision: str) -> torch.nn.Module:
    """A stand-in rollout engine synced with the actor: a copy holding its weights in the dtype
    the pipeline's engine takes them in (`factory.engine_settings`: bf16 beside a bf16 trainer on a GPU)."""
    dtype = getattr(torch, engine_settings(RolloutEngineConfig(), precision, actor.device.type)["dtype"])
    return copy.deepcopy(actor).to(dtype).eval().requires_grad_(False)


def said(model, probe: Probe, precision: str | None) -> list[torch.Tensor]:
    """The log-probs `model` gives the probe's response tokens (`policy_step.teacher_forced`): in
    the trainer's `precision`, or None: in the model's own dtype, as an engine computes."""
    return teacher_forced(model, probe.rows, PAD, precision or "fp32", model.device, PROBE_ROWS)


def sync_checks(actor, stale, probe: Probe, precision: str, said_before) -> dict:
    """The policy stage's check of a weight sync (`rlhf_core.rollout.sync_check`) on the stand-in
    engine: synced after the update it passes; left as it sampled (a sync that did nothing) it
    fails, when the update moved the policy beyond the precision's noise."""
    bound = prob_diff_bound(CircuitBreakerConfig(), precision, max_lag=0)
    trainer = said(actor, probe, precision)
    engine_before, trainer_before = said_before
    synced = verdict([[t.tolist() for t in said(engine_copy(actor, precision), probe, None)]], trainer,
                     [[t.tolist() for t in engine_before]], trainer_before)
    kept = verdict([[t.tolist() for t in said(stale, probe, None)]], trainer,
                   [[t.tolist() for t in engine_before]], trainer_before)
    failed = []
    if (why := synced.failure(bound, probe.tokens)) is not None:
        failed.append(f"a synced engine failed the sync check: {why}")
    if kept.trainer_moved > 2 * kept.noise and kept.failure(bound, probe.tokens) is None:
        failed.append(f"the sync check passed an engine that kept its weights (gap {kept.gap:.3g}, trainer moved "
                      f"{kept.trainer_moved:.3g}, noise {kept.noise:.3g})")
    print(f"  sync check: synced engine gap {synced.gap:.2e} (bound {bound:g}); an engine that kept its weights: "
          f"gap {kept.gap:.2e}, moved {kept.moved:.2e} against the trainer's {kept.trainer_moved:.2e} (noise "
          f"{kept.noise:.2e}): {'caught' if kept.failure(bound, probe.tokens) else 'not judged: within the noise'}")
    return {"gap": synced.gap, "failed": failed}


def watched_weights(actor) -> dict[str, torch.Tensor]:
    """Two weight matrices, in the first and the last layer, to see the update move them."""
    layers = actor.model.layers
    return {"layers.0.q_proj": layers[0].self_attn.q_proj.weight,
            f"layers.{len(layers) - 1}.down_proj": layers[-1].mlp.down_proj.weight}


def step_checks(actor, reference, optimizer, batch: PolicyBatch, metrics: dict, before: dict,
                actor_dtype: torch.dtype = torch.float32) -> list[str]:
    """What must hold after a step; -> the ones that did not. `optimizer`: the torch optimizer
    that holds the trained weights' state; `actor_dtype`: the dtype the actor computes in."""
    device = actor.device.type
    failed = []
    tensors = {f.name: getattr(batch, f.name) for f in fields(batch) if getattr(batch, f.name) is not None}
    if off := sorted(name for name, t in tensors.items() if t.device.type != device):
        failed.append(f"batch tensors not on {device}: {off}")
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    if not state or any(t.device.type != device for t in state):
        failed.append(f"optimizer state missing or not on {device}")
    want_ref = torch.bfloat16 if device == "cuda" else torch.float32
    actor_dtypes, ref_dtypes = {p.dtype for p in actor.parameters()}, {p.dtype for p in reference.parameters()}
    if actor_dtypes != {actor_dtype} or ref_dtypes != {want_ref}:
        failed.append(f"dtypes: actor {actor_dtypes}, reference {ref_dtypes} (want {actor_dtype} and {want_ref})")
    for key in ("pg_loss", "grad_norm", "entropy", "approx_kl", "kl", "logprob_diff"):
        if not math.isfinite(metrics[key]):
            failed.append(f"{key} is not finite")
    if metrics["nonfinite_skipped"]:
        failed.append(f"{metrics['nonfinite_skipped']:.0f} optimizer step(s) skipped for non-finite gradients")
    if unmoved := sorted(k for k, w in watched_weights(actor).items() if torch.equal(w.detach(), before[k])):
        failed.append(f"the update left these weights unchanged: {unmoved}")
    return failed


def memory_summary(plan: Plan, steps: list[dict]) -> dict:
    """The measured peaks beside the preflight's GPU arithmetic (`gpu_policy_bytes`, no engine) for this
    check's step: an fp32 actor with AdamW, its reference frozen, a micro-batch of the longest rows. GiB."""
    peaks = [v for s in steps for v in (s["peak_gpu_memory_gib"] or {}).values()]
    if not peaks:
        return {"peak_gpu_memory_gib": None}
    in_use, m, n = max(v for s in steps for v in s["gpu_memory_in_use_gib"].values()), plan.model, parameter_count(plan)
    parts = {k: b / 2**30 for k, b in gpu_policy_bytes(GpuPolicyShape(
        parameters=n, num_layers=m["num_hidden_layers"], hidden_size=m["hidden_size"], frozen_parameters=n,
        kv_width=m["num_key_value_heads"] * m["hidden_size"] // m["num_attention_heads"], vocab_size=m["vocab_size"],
        intermediate_size=m["intermediate_size"], micro_batch_size=plan.micro_batch, response_tokens=plan.new_tokens,
        sequence_tokens=plan.prompt_tokens[1] + plan.new_tokens)).items()}
    total = sum(parts.values())
    print(f"\npeak GPU memory (torch.cuda.max_memory_allocated): {max(peaks):.2f} GiB; the device's memory in use "
          f"(its context and the allocator's cache too) at most {in_use:.2f} GiB\nthe preflight's estimate of this "
          f"step: {total:.2f} GiB (" + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()) + f"): {total / in_use:.2f} "
          f"of the memory in use; without its overhead {(total - parts['overhead']) / max(peaks):.2f} of the peak")
    return {"peak_gpu_memory_gib": max(peaks), "gpu_memory_in_use_gib": in_use,
            "preflight_estimate_gib": {**parts, "total": total}}


def print_step(result: dict, device: torch.device) -> None:
    s, m = result["seconds"], result["metrics"]
    other = s["total"] - s["generate"] - s["logprobs"] - s["update"]
    warm = " (includes CUDA's warm-up)" if device.type == "cuda" and result["step"] == 1 else ""
    print(f"step {result['step']}{warm}: {s['total']:.2f} s = generate {s['generate']:.2f} + logprobs "
          f"{s['logprobs']:.2f} + update {s['update']:.2f} + other {other:.2f}; "
          f"{result['generated_tokens']} tokens generated, {result['generated_tokens_per_s']:,.0f} tokens/s")
    if result["peak_gpu_memory_gib"]:
        print("  peak GPU memory (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in result["peak_gpu_memory_gib"].items()))
    print(f"  pg_loss {m['pg_loss']:.4f}, grad_norm {m['grad_norm']:.3f}, kl per answer {m['kl']:.2e}, approx_kl "
          f"{m['approx_kl']:.2e}, logprob_diff (generate vs trainer) {m['logprob_diff']:.2e}, "
          f"score_mean {m['score_mean']:.3f}, response_length {m['response_length']:.1f}")
    for failure in result["failed_checks"]:
        print(f"  CHECK FAILED: {failure}")
