"""Check the GPU path of the project on one GPU in a few minutes, with torch, transformers and
peft alone (no Ray, DeepSpeed, vLLM, Prefect or MLflow: a GPU machine may have none of them).

1. The device tests (`tests/rlhf_core/test_on_devices.py`: the step's phases, logits, losses
   and advantages, frozen-model placement, bf16 autocast, each on the CPU and on CUDA), and on
   a GPU also the CPU tests of the same torch code, under that machine's torch and transformers.
2. GRPO steps on a random-weight Llama of Qwen2.5-0.5B's shape (vocabulary cut to 32,000),
   built on the device, through the project's own step code (`rlhf_core.training.policy_step`) as
   the policy worker runs it: fp32 weights under bf16 autocast, the reference frozen in bf16
   (`frozen_on`), fused AdamW. Rollouts come from Hugging Face `generate` (sampling, a group of
   answers per prompt; the rollout engine, vLLM, is not there) and are scored by a dummy
   verifiable reward, the share of even token ids in the answer: there is no reward model.
   Printed per step: time in generate, logprobs (old and reference), update and the rest, tokens/s and
   peak GPU memory per phase (step 1 includes CUDA's warm-up); then the peak beside the preflight's.

Without a CUDA device, or with --dry-run, it is a dry run: everything on the CPU, the device
tests' CUDA cases skipped, and one step on a tiny Llama so that the code path runs; it prints
what it would run on a GPU. Its figures are CPU figures and go to gpu_check_dryrun.json, never
to gpu_check.json.

    make gpu-check                           # python bench/gpu_check.py from the repository root
    python bench/gpu_check.py --dry-run      # on the CPU, in well under a minute

Needs pytest, pyyaml and pydantic (the configs) beside torch and transformers. Exit status 0 when
the tests pass and every step's checks hold, 1 otherwise, 2 when a package is missing.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from bench.common import machine as common_machine, write_json  # noqa: E402 - torch and psutil only

try:
    from rlhf_core.config import PolicyConfig
    from rlhf_core.models.memory import GpuPolicyShape, gpu_policy_bytes
    from rlhf_core.models.placement import frozen_on
    from rlhf_core.training.policy_step import (
        PolicyBatch, TorchBackwardAndStep, algorithm_spec, batched_logprobs, build_batch, compute_advantages,
        old_logprobs_from_update, rollout_metrics, token_rewards, update_minibatches,
    )
    from rlhf_core.training.precision import computing_in, resolve_precision
except ModuleNotFoundError as missing:  # a GPU machine has no pydantic unless it is carried along
    print(f"gpu_check: the module {missing.name!r} is missing. rlhf_core's configs need pydantic: carry the wheels of "
          "pydantic, pydantic-core, annotated-types, typing-inspection and typing-extensions (docs/performance-notes.md)",
          file=sys.stderr)
    sys.exit(2)

RESULTS = REPO / "bench" / "results"
DEVICE_TESTS = ["tests/rlhf_core/test_on_devices.py"]
# CPU tests of the same torch code (none needs Ray, DeepSpeed, vLLM, Prefect or MLflow): on a GPU
# machine they check that machine's torch and transformers; a dry run here leaves them to the suite.
TORCH_TESTS = ["tests/rlhf_core/algos", "tests/rlhf_core/training/test_policy_step.py",
               "tests/rlhf_core/models/test_llama.py", "tests/rlhf_core/models/test_value.py",
               "tests/rlhf_core/models/test_lora.py", "tests/rlhf_core/models/test_memory.py"]
PAD, BOS, EOS = 0, 1, 2
SUMMARY = re.compile(r"\d+ (passed|failed|errors?|skipped|deselected)\b.* in [\d.]+s")  # pytest's last line


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


# ----------------------------------------------------------------------------- the device tests


def run_tests(files: list[str], dry_run: bool) -> dict:
    """pytest on `files` in a subprocess, its output shown as it comes. A dry run hides any GPU."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5", *files]
    print("$ " + " ".join(["python", *cmd[1:]]), flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line.strip())
    returncode = proc.wait()
    summary = next((line.strip("= ") for line in reversed(lines) if SUMMARY.search(line)), "no pytest summary")
    return {"files": files, "returncode": returncode, "summary": summary, "seconds": time.perf_counter() - start}


# ----------------------------------------------------------------------------- one GRPO step


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


def grpo_step(actor, reference, optimizer, prompts, plan: Plan, cfg: PolicyConfig, precision: str, step: int) -> dict:
    """One GRPO step through `rlhf_core.training.policy_step`, in the policy worker's order."""
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
    with phase(record, "update", device), computing_in(precision, device):
        update = update_minibatches(actor, batch, spec, cfg, TorchBackwardAndStep(actor.parameters(), optimizer,
                                                                                  cfg.max_grad_norm),
                                    minibatch_size=cfg.minibatch_size, kl_coef=cfg.kl_coef,
                                    generator=torch.Generator().manual_seed(step))
    total = time.perf_counter() - start
    generated = int(batch.response_mask.sum())
    metrics = {**rollout_metrics(batch), **update, "score_mean": batch.scores.mean().item()}
    return {"step": step, "seconds": {**record["seconds"], "total": total},
            "peak_gpu_memory_gib": record["peak_gib"] or None, "gpu_memory_in_use_gib": record["in_use_gib"] or None,
            "generated_tokens": generated, "generated_tokens_per_s": generated / record["seconds"]["generate"],
            "metrics": metrics, "failed_checks": step_checks(actor, reference, optimizer, batch, metrics, before)}


def watched_weights(actor) -> dict[str, torch.Tensor]:
    """Two weight matrices, in the first and the last layer, to see the update move them."""
    layers = actor.model.layers
    return {"layers.0.q_proj": layers[0].self_attn.q_proj.weight,
            f"layers.{len(layers) - 1}.down_proj": layers[-1].mlp.down_proj.weight}


def step_checks(actor, reference, optimizer, batch: PolicyBatch, metrics: dict, before: dict) -> list[str]:
    """What must hold after a step; -> the ones that did not."""
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
    if actor_dtypes != {torch.float32} or ref_dtypes != {want_ref}:
        failed.append(f"dtypes: actor {actor_dtypes}, reference {ref_dtypes} (want fp32 and {want_ref})")
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


def run_grpo(plan: Plan, device: torch.device) -> dict:
    precision = resolve_precision("auto", use_gpu=True) if device.type == "cuda" else "bf16"
    cfg = policy_config(plan, precision)
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        actor = LlamaForCausalLM(llama_config(plan))  # fp32 weights: the trainer keeps them so
    reference = frozen_on(copy.deepcopy(actor), device)  # bf16 on a GPU, as the policy worker's
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(actor.parameters(), lr=cfg.learning_rate, weight_decay=0.0, fused=fused)
    built = time.perf_counter() - start
    memory_after_build = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    print(f"built in {built:.1f} s: actor fp32, reference {next(reference.parameters()).dtype}, AdamW "
          f"(fused={fused}), computing in {precision}", flush=True)
    steps = []
    for step in range(1, plan.steps + 1):
        result = grpo_step(actor, reference, optimizer, random_prompts(plan, seed=step), plan, cfg, precision, step)
        print_step(result, device)
        steps.append(result)
    return {"precision": precision, "build_seconds": built, "memory_after_build_gib": memory_after_build,
            "parameters": sum(p.numel() for p in actor.parameters()), "steps": steps}


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


# ----------------------------------------------------------------------------- the whole check


def machine(device: torch.device) -> dict:
    info = common_machine(engine=False) | {"transformers": transformers.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda}
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="on the CPU with a tiny model, even where CUDA is")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: 2 on a GPU, 1 in a dry run)")
    parser.add_argument("--out", type=Path, default=None, help="result file (default: bench/results/gpu_check.json, "
                                                               "or gpu_check_dryrun.json in a dry run)")
    args = parser.parse_args()
    dry_run = args.dry_run or not torch.cuda.is_available()
    plan = DRY_PLAN if dry_run else GPU_PLAN
    plan = plan if args.steps is None else replace(plan, steps=args.steps)
    device = torch.device("cpu" if dry_run else "cuda")
    out = args.out or RESULTS / ("gpu_check_dryrun.json" if dry_run else "gpu_check.json")
    if dry_run:
        why = "--dry-run" if args.dry_run else "no CUDA device"
        print(f"gpu_check: DRY RUN on the CPU ({why}). Every figure below is a CPU dry-run figure, not a GPU one.")
        print(f"On a GPU it would run: pytest on {' '.join(DEVICE_TESTS + TORCH_TESTS)} (CUDA cases included), then "
              f"GRPO on a {GPU_PLAN.describe()}; bf16 autocast, fused AdamW.")
        print(f"This dry run: the device tests with their CUDA cases skipped, then GRPO on a {plan.describe()}.",
              flush=True)
    else:
        print(f"gpu_check on {torch.cuda.get_device_name(device)}: the device tests, then GRPO on a {plan.describe()}.",
              flush=True)

    print("\n[1/2] device tests", flush=True)
    tests = run_tests(DEVICE_TESTS if dry_run else DEVICE_TESTS + TORCH_TESTS, dry_run)
    print(f"\n[2/2] GRPO on {device.type}", flush=True)
    try:
        grpo = run_grpo(plan, device)
        failed = [f"step {s['step']}: {f}" for s in grpo["steps"] for f in s["failed_checks"]]
    except Exception as error:  # an OOM or a bug on the device: keep the tests' result, say what broke
        traceback.print_exc()
        grpo = {"steps": [], "parameters": None, "error": f"{type(error).__name__}: {error}"}
        failed = [f"GRPO: {grpo['error']}"]
    if tests["returncode"] != 0:
        failed.insert(0, f"device tests: pytest exited {tests['returncode']} ({tests['summary']})")
    payload = {"machine": machine(device), "dry_run": dry_run, "device": device.type,
               "model": {"shape": plan.name, **plan.model, "parameters": parameter_count(plan)},
               "batch": {f.name: getattr(plan, f.name) for f in fields(plan) if f.name not in ("name", "model")},
               "tests": tests, "grpo": grpo, **memory_summary(plan, grpo["steps"]), "failed": failed}
    write_json(out, payload)
    kind = "dry run (CPU figures)" if dry_run else "GPU check"
    print(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    if failed:
        print(f"gpu_check: {kind} FAILED:\n  " + "\n  ".join(failed))
        return 1
    print(f"gpu_check: {kind} passed: {tests['summary']}; {len(grpo['steps'])} GRPO step(s) with every check held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
