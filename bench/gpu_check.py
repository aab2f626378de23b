"""Check the GPU path of the project on one GPU in a few minutes, with torch, transformers and
peft (no Ray, vLLM, Prefect or MLflow: a GPU machine may have none of them; DeepSpeed where it
is installed or carried).

1. The device tests (`tests/rlhf_core/test_on_devices.py`: the step's phases, logits, losses
   and advantages, frozen-model placement, bf16 autocast, each on the CPU and on CUDA), and on
   a GPU also the CPU tests of the same torch code, under that machine's torch and transformers.
2. GRPO steps on a random-weight Llama of Qwen2.5-0.5B's shape (vocabulary cut to 32,000),
   built on the device, through the project's own step code (`bench/gpu_step.py`): fp32 weights
   under bf16 autocast, the reference frozen in bf16 (`frozen_on`), torch's fused AdamW; after
   each update the policy stage's check of a weight sync (`rlhf_core.rollout.sync_check`) on a
   stand-in engine in the engine's dtype: synced it must pass, left as it sampled it must fail.
3. The same steps under DeepSpeed, as the policy stage runs them on GPUs: its own engine
   (`deepspeed_engine.policy_engine`: bf16 weights, fp32 master weights, ZeRO-1) over a process
   group of one.
4. The training stages' real worker loops (`bench/gpu_loops.py`), through each stage's driver
   function, in a world of one standing in for Ray Train's (`train_context.one_process`: a real
   NCCL group), on a model of the plan's shape, the rollout engine a stand-in in a second process
   that takes the weights by CUDA IPC (`bench/stand_in_engine.py`), every sync checked:
   - the reward model and its audit model, each scored on its held-out pairs on the device, then
     GRPO rewarded by them: each process killed after step 2 (`RLHF_FAULT`) and run again, which
     must resume from step 1 and redo step 2 with the same loss;
   - one step each of PPO with its critic, GRPO under ZeRO-3, GRPO with LoRA and gradient
     checkpointing, and DPO with every weight trained, with LoRA and under ZeRO-3;
   - GRPO with every sync skipped, which must stop at the check after the sync.
5. The memory hand-off between the trainer and a sleeping colocated engine (`bench/gpu_handoff.py`)
   at the one-GPU plan's part sizes (`configs/gpu-1xh100-0.5b.yaml`, the preflight's parts): the
   device's memory in use at each turn of a step, the free memory the engine finds when it wakes
   (after the trainer handed its cache back), against the preflight's estimate.
6. The gates on 16 prompts on the device, through the function the gate stage runs as a Ray task
   (`rlhf_core.eval.gate_models.evaluate_on`: every model on the GPU, in bf16): a random-weight
   candidate and reference of the plan's shape, and a reward model built from the reference,
   saved and loaded as a run saves them. Each policy answers from the stand-in engine in a
   process of its own, in serving's dtype, one engine at a time, where the gate stage opens vLLM.
   It records the seconds, the engines' start and the peak GPU memory.

Phases 3 and 4 are left out, and said, where DeepSpeed is not installed. Not in it: vLLM itself
(its kernels, sleep mode and packed IPC buffer).

The JSON is written after every phase, so a run cut short still reports what it did. Each
run prints per step the time in generate, logprobs (old and reference), update and the
rest, tokens/s and peak GPU memory per phase (step 1 includes CUDA's warm-up), then its peak
beside the preflight's estimate of the same step; each worker loop its seconds, peak allocated and
reserved GPU memory, its syncs' seconds and `rollout/prob_diff`.

Without a CUDA device, or with --dry-run, it is a dry run: everything on the CPU, the device
tests' CUDA cases skipped, and one step on a tiny Llama so that the code path runs; it prints
what it would run on a GPU. Its figures are CPU figures and go to gpu_check_dryrun.json, never
to gpu_check.json.

    make gpu-check                           # python bench/gpu_check.py from the repository root
    python bench/gpu_check.py --dry-run      # on the CPU, in about a minute

Needs pytest, pyyaml and pydantic (the configs) beside torch and transformers. Exit status 0 when
the tests pass and every step's checks hold, 1 otherwise, 2 when a package is missing.
"""
from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import fields, replace
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from bench.common import machine as common_machine, write_json  # noqa: E402 - torch and psutil only

try:
    from bench.gpu_loops import policy_dir, run_loops
    from bench.gpu_step import (
        DRY_PLAN, GPU_PLAN, Plan, grpo_step, llama_config, memory_summary, parameter_count, policy_config, print_step,
        random_prompts, step_checks,
    )
    from rlhf_core.distributed import train_context
    from rlhf_core.distributed.deepspeed_engine import (
        DeepSpeedBackwardAndStep, import_deepspeed, policy_engine, saved_dtype,
    )
    from rlhf_core.models.placement import frozen_on
    from rlhf_core.training.policy_step import TorchBackwardAndStep
    from rlhf_core.training.precision import resolve_precision
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


# ----------------------------------------------------------------------------- the GRPO steps


def run_grpo(plan: Plan, device: torch.device, deepspeed=None) -> dict:
    """GRPO steps on a fresh random-weight actor beside its frozen reference: with plain torch (fp32
    weights, torch's AdamW), or, given `deepspeed` (the module), as the policy stage runs them: the
    stage's own engine (`deepspeed_engine.policy_engine`: bf16 weights with fp32 master weights on a
    GPU, fp32 on the CPU; ZeRO-1; torch's AdamW, fused on a GPU) and `DeepSpeedBackwardAndStep`."""
    cuda = device.type == "cuda"
    precision = resolve_precision("auto", use_gpu=True) if cuda else "bf16"
    cfg = policy_config(plan, precision)
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        actor = LlamaForCausalLM(llama_config(plan))  # fp32 weights: the trainer keeps them so
    reference = frozen_on(copy.deepcopy(actor), device)  # bf16 on a GPU, as the policy worker's
    if deepspeed is None:
        optimizer = torch.optim.AdamW(actor.parameters(), lr=cfg.learning_rate, weight_decay=0.0, fused=cuda)
        stepper, actor_dtype = TorchBackwardAndStep(actor.parameters(), optimizer, cfg.max_grad_norm), torch.float32
        how = f"plain torch, actor fp32, AdamW (fused={cuda})"
    else:
        engine = policy_engine(deepspeed, actor, cfg, cfg.learning_rate, use_gpu=cuda)
        actor, optimizer, stepper = engine.module, engine.optimizer.optimizer, DeepSpeedBackwardAndStep(engine)
        actor_dtype = saved_dtype(cuda) or torch.float32  # DeepSpeed computes in bf16 on a GPU
        how = (f"DeepSpeed {deepspeed.__version__}, ZeRO-{cfg.zero_stage}, actor {actor_dtype}, "
               f"{type(engine.optimizer).__name__} over {type(optimizer).__name__}")
    built = time.perf_counter() - start
    memory_after_build = torch.cuda.memory_allocated(device) / 2**30 if cuda else None
    print(f"built in {built:.1f} s: {how}, reference {next(reference.parameters()).dtype}, computing in {precision}",
          flush=True)
    check = partial(step_checks, actor, reference, optimizer, actor_dtype=actor_dtype)
    steps = []
    for step in range(1, plan.steps + 1):
        result = grpo_step(actor, reference, stepper, random_prompts(plan, seed=step), plan, cfg, precision, step, check)
        print_step(result, device)
        steps.append(result)
    return {"trainer": how, "precision": precision, "build_seconds": built, "memory_after_build_gib": memory_after_build,
            "parameters": sum(p.numel() for p in actor.parameters()), "steps": steps}


def import_deepspeed_here(device: torch.device):
    """DeepSpeed, imported as the training workers do (its CPU accelerator on the CPU); None, said,
    where it is not installed (a GPU machine may not have it)."""
    try:
        return import_deepspeed(use_gpu=device.type == "cuda")
    except ImportError as missing:
        print(f"DeepSpeed is not installed here ({missing}): the steps under DeepSpeed are left out", flush=True)
        return None


def measured_run(label: str, plan: Plan, device: torch.device, failed: list[str], deepspeed=None) -> dict:
    """`run_grpo` with its memory beside the preflight's estimate; what did not hold is added to
    `failed`. An OOM or a bug on the device becomes the run's error, so the rest of the check runs."""
    try:
        run = run_grpo(plan, device, deepspeed)
    except Exception as error:
        traceback.print_exc()
        run = {"steps": [], "error": f"{type(error).__name__}: {error}"}
        failed.append(f"{label}: {run['error']}")
    run["memory"] = memory_summary(plan, run["steps"])
    failed += [f"{label} step {s['step']}: {f}" for s in run["steps"] for f in s["failed_checks"]]
    if device.type == "cuda":  # the next run starts from an empty allocator
        gc.collect()
        torch.cuda.empty_cache()
    return run


# ----------------------------------------------------------------------------- the memory hand-off


def run_handoff_phase(device: torch.device) -> dict:
    """`bench/gpu_handoff.py`'s turns, with a stand-in engine on a tiny model -> its figures and what failed."""
    from bench.gpu_handoff import run_handoff  # noqa: PLC0415

    try:
        with tempfile.TemporaryDirectory(prefix="gpu-check-handoff-") as tmp:
            result = run_handoff(policy_dir(DRY_PLAN, Path(tmp) / "engine"), device)
    except Exception as error:
        traceback.print_exc()
        return {"error": f"{type(error).__name__}: {error}", "failed_checks": [f"{type(error).__name__}: {error}"]}
    result["failed_checks"] = [name for name, held in result["checks"].items() if not held]
    turns = "; ".join(f"{turn}: {v:.1f} GiB in use" for turn, v in result["in_use_gib"].items() if v is not None)
    print(f"the engine's share {result['parts_gib']['engine']:.1f} GiB, the preflight's rank 0 "
          f"{result['preflight_rank0_gib']:.1f} GiB" + (f"; {turns}; peak {result['peak_in_use_gib']:.1f} GiB, "
                                                         f"{result['free_at_wake_gib']:.1f} GiB free at the wake, "
                                                         f"would have fitted without the cache handed back: "
                                                         f"{result['would_fit_without_release']}" if turns else
                                                         " (at 1/1024 on the CPU: nothing measured)"), flush=True)
    return result


# ----------------------------------------------------------------------------- the gates


def run_gates(plan: Plan, device: torch.device, prompts: int = 16) -> dict:
    """The gate stage's comparison on `device` (`gate_models.evaluate_on`) of two random-weight
    policies of the plan's shape on a demo-task tokenizer, scored by a reward model built from the
    reference, each policy answering from a stand-in engine in a process of its own in serving's
    dtype (bf16 on a GPU: the GPU configs' `serving.dtype`), one at a time, as vLLM's would;
    -> its seconds, peak GPU memory and figures, and the checks that did not hold."""
    from rlhf_core.config import PipelineConfig  # noqa: PLC0415
    from rlhf_core.data.synthetic import answer_for, prompt_for  # noqa: PLC0415
    from rlhf_core.eval.gate_models import GateModels, evaluate_on  # noqa: PLC0415
    from rlhf_core.models.placement import frozen_dtype  # noqa: PLC0415
    from rlhf_core.models.reward import reward_model_from_base, reward_stats, save_reward_model, score  # noqa: PLC0415
    from rlhf_core.tokenizer import load_tokenizer  # noqa: PLC0415

    from bench.stand_in_engine import StandInEngine  # noqa: PLC0415

    problems = [(a, (a * 37 + 11) % 100) for a in range(prompts)]
    serving_dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg = PipelineConfig.model_validate({"policy": {"max_new_tokens": 4}, "serving": {"dtype": serving_dtype},
                                         "gates": {"eval_prompts": prompts, "bootstrap_samples": 200}})
    engines: list[float] = []

    def stand_in(model_dir: Path, max_num_seqs: int, max_model_len: int) -> StandInEngine:
        engine = StandInEngine(model_dir, dtype=serving_dtype, device=device, seed=0, max_model_len=max_model_len)
        engines.append(engine.last_metrics["rollout/engine_start_s"])
        return engine

    with tempfile.TemporaryDirectory(prefix="gpu-check-gates-") as tmp:
        reference = policy_dir(plan, Path(tmp) / "reference", seed=0)
        candidate = policy_dir(plan, Path(tmp) / "candidate", seed=1)
        tok = load_tokenizer(reference)
        rm = reward_model_from_base(reference, seed=0).eval()
        texts = [prompt_for(a, b, 2) for a, b in problems]
        stats = reward_stats(score(rm, tok, texts, [answer_for(a + b, 2) for a, b in problems], max_length=16))
        save_reward_model(rm, tok, Path(tmp) / "reward", stats)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        result = evaluate_on(device, GateModels(candidate, reference, Path(tmp) / "reward"), texts,
                             [answer_for(a + b, 2) for a, b in problems], cfg, open_engine=stand_in)
        seconds = time.perf_counter() - start
    metrics = result.metrics()
    failed = [f"{name} is not finite ({value})" for name, value in metrics.items() if not math.isfinite(value)]
    if result.reference.figures.win_rate_vs_reference != 0.5:
        failed.append(f"the reference's win rate against itself is {result.reference.figures.win_rate_vs_reference}")
    if len(engines) != 2:
        failed.append(f"{len(engines)} engines opened for two policies whose first look holds every prompt")
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    memory = "" if peak is None else f", peak GPU memory {peak:.2f} GiB"
    dtype = frozen_dtype(device) or torch.float32  # the gates' models as `evaluate_on` froze them
    print(f"gates on {prompts} prompts in {seconds:.1f} s on {device.type} (models {dtype}, answers from "
          f"{len(engines)} stand-in engines in {serving_dtype}, started in {sum(engines):.1f} s){memory}: candidate "
          f"KL {result.candidate.figures.kl_to_reference:.4f}, win rate {result.candidate.figures.win_rate_vs_reference:.3f}",
          flush=True)
    return {"prompts": prompts, "seconds": seconds, "dtype": str(dtype), "serving_dtype": serving_dtype,
            "engine_start_s": engines, "peak_gpu_memory_gib": peak,
            "metrics": metrics, "failed_checks": failed}


# ----------------------------------------------------------------------------- the whole check


def machine(device: torch.device) -> dict:
    info = common_machine(engine=False) | {"transformers": transformers.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda}
    return info


def say_what_runs(dry_run: bool, why: str, plan: Plan, device: torch.device) -> None:
    if not dry_run:
        print(f"gpu_check on {torch.cuda.get_device_name(device)}: the device tests, then GRPO on a {plan.describe()}, "
              "then the worker loops, the memory hand-off and the gates.", flush=True)
        return
    print(f"gpu_check: DRY RUN on the CPU ({why}). Every figure below is a CPU dry-run figure, not a GPU one.")
    print(f"On a GPU it would run: pytest on {' '.join(DEVICE_TESTS + TORCH_TESTS)} (CUDA cases included), then "
          f"GRPO on a {GPU_PLAN.describe()}; with plain torch (bf16 autocast, fused AdamW), then under DeepSpeed; "
          "then the reward, GRPO, PPO and DPO stages' worker loops on that shape in bf16; then the memory hand-off "
          "between trainer and engine at the one-GPU plan's part sizes; then the gates on 16 prompts, every model on "
          "the GPU in bf16, the answers from a stand-in engine in bf16.")
    print(f"This dry run: the device tests with their CUDA cases skipped, then GRPO on a {plan.describe()}, then "
          "the worker loops on that shape, the hand-off's turns at 1/1024 and the gates, on the CPU in fp32.",
          flush=True)


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
    say_what_runs(dry_run, "--dry-run" if args.dry_run else "no CUDA device", plan, device)

    failed: list[str] = []
    payload = {"machine": machine(device), "dry_run": dry_run, "device": device.type,
               "model": {"shape": plan.name, **plan.model, "parameters": parameter_count(plan)},
               "batch": {f.name: getattr(plan, f.name) for f in fields(plan) if f.name not in ("name", "model")},
               "phases_done": [], "failed": failed}

    def done(phase: str, **results) -> None:  # the JSON after every phase: a run cut short still reports
        payload.update(results)
        payload["phases_done"].append(phase)
        write_json(out, payload)

    print("\n[1/6] device tests", flush=True)
    tests = run_tests(DEVICE_TESTS if dry_run else DEVICE_TESTS + TORCH_TESTS, dry_run)
    failed += [] if tests["returncode"] == 0 else [f"device tests: pytest exited {tests['returncode']} ({tests['summary']})"]
    done("device tests", tests=tests)
    print(f"\n[2/6] GRPO on {device.type}, plain torch", flush=True)
    grpo = measured_run("GRPO", plan, device, failed)
    done("GRPO", grpo=grpo)
    print(f"\n[3/6] GRPO on {device.type} under DeepSpeed, as the policy stage runs it", flush=True)
    deepspeed = import_deepspeed_here(device)
    grpo_ds = None
    if deepspeed:  # over a process group of one (NCCL on a GPU, gloo on the CPU), closed after the steps
        with tempfile.TemporaryDirectory(prefix="gpu-check-ds-") as tmp, \
                train_context.one_process(Path(tmp), use_gpu=device.type == "cuda"):
            deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")  # wraps its group
            grpo_ds = measured_run("GRPO under DeepSpeed", plan, device, failed, deepspeed)
    peaks = [r["memory"]["peak_gpu_memory_gib"] for r in (grpo, grpo_ds) if r and r["memory"]["peak_gpu_memory_gib"]]
    done("GRPO under DeepSpeed", grpo_deepspeed=grpo_ds, peak_gpu_memory_gib=max(peaks, default=None))
    print(f"\n[4/6] the training stages' worker loops on {device.type} (bench/gpu_loops.py)", flush=True)
    if deepspeed:
        loops, loop_failures = run_loops(dry_run, done)
        failed += loop_failures
    else:
        loops = None
        print("the worker loops are left out: they train under DeepSpeed, which is not installed here", flush=True)
        done("worker loops left out", loops=None)
    print(f"\n[5/6] the memory hand-off between the trainer and a sleeping engine on {device.type}, at the "
          "preflight's part sizes", flush=True)
    handoff = run_handoff_phase(device)
    failed += [f"memory hand-off: {f}" for f in handoff["failed_checks"]]
    done("memory hand-off", handoff=handoff)
    print(f"\n[6/6] the gates on {device.type}, as the gate stage runs them", flush=True)
    try:
        gates = run_gates(plan, device)
    except Exception as error:
        traceback.print_exc()
        gates = {"error": f"{type(error).__name__}: {error}", "failed_checks": [f"{type(error).__name__}: {error}"]}
    failed += [f"gates: {f}" for f in gates["failed_checks"]]
    done("gates", gates=gates)
    kind = "dry run (CPU figures)" if dry_run else "GPU check"
    print(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    if failed:
        print(f"gpu_check: {kind} FAILED:\n  " + "\n  ".join(failed))
        return 1
    runs = "plain torch" + (" and under DeepSpeed" if grpo_ds else " (DeepSpeed not installed)")
    loop_runs = f"the worker loops of {', '.join(loops)}; " if loops else ""
    print(f"gpu_check: {kind} passed: {tests['summary']}; {len(grpo['steps'])} GRPO step(s) {runs}; {loop_runs}"
          "the gates in "
          f"{gates['seconds']:.1f} s; every check held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
