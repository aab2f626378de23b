"""The training stages' real worker loops on one device, in this process, without Ray: what
`bench/gpu_check.py` runs, the runs killed and resumed in processes of their own (a kill ends
that process alone), the one-step runs one after another in another.

`rlhf_core.distributed.train_context.one_process` stands in for Ray Train's worker context: a
world of one over a real process group (NCCL on a GPU, gloo on the CPU), checkpoints committed
to a directory. Each run calls its stage's own driver function (`train_reward_models`,
`train_policy`, `train_offline`), which runs the worker loop here: DeepSpeed's engine, the
checkpoints, the resume, the held-out pass on the stage's device and the save, as the pipeline
runs them. The policy stage's rollout engine is `bench/stand_in_engine.py` (vLLM is not on a GPU
check's machine): a model in a second process that takes the weights by CUDA IPC after every
update, each sync checked by the stage against the trainer's log-probs.

    reward       the reward model and its audit model, checkpointed every step, each scored on
                 the held-out pairs on the device (5 and 1 steps)
    grpo         GRPO rewarded by that reward model, the answer key and measured by the audit
                 model; 4 steps, checkpointed every step
    ppo          PPO with its critic, 1 step
    grpo-zero3   GRPO under ZeRO-3, 1 step
    grpo-lora    GRPO with LoRA adapters and gradient checkpointing, 1 step
    grpo-unsynced  GRPO, 1 step, run with RLHF_FAULT=skip:policy:sync: the engine keeps its weights,
                 and the stage must stop at the check after the sync, saying so
    dpo          DPO, every weight trained, 2 steps, then its held-out pass on the device
    dpo-lora     the same with LoRA adapters and gradient checkpointing
    dpo-zero3    the same under ZeRO-3

Run with RLHF_FAULT=kill:reward:step2:rank0 (or kill:policy:step2:rank0) the process dies after
step 2, before its checkpoint; run again with the same --work it resumes from step 1.

The policy starts as a random-weight Llama of the check's shape (`bench/gpu_step.py`'s plan) on
a tokenizer of the demo's sums: the figures test the code path and its memory, not learning.

    python bench/gpu_loops.py RUN [RUN ...] --work DIR [--dry-run]     # writes DIR/RUN.json

Needs torch, transformers, peft, pydantic, msgpack and DeepSpeed (a GPU machine: carried as
wheels, docs/gpu.md); not Ray, vLLM, Prefect or MLflow.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.gpu_step import DRY_PLAN, GPU_PLAN, Plan  # noqa: E402
from bench.stand_in_engine import open_stand_in  # noqa: E402
from rlhf_core.config import ModelConfig, PolicyConfig, RewardConfig  # noqa: E402
from rlhf_core.data.synthetic import answer_for, near_miss, prompt_for  # noqa: E402
from rlhf_core.distributed import train_context  # noqa: E402
from rlhf_core.models.llama import build_policy, save_pretrained_atomic  # noqa: E402
from rlhf_core.testing.sinks import JsonlSink  # noqa: E402
from rlhf_core.tokenizer import train_tokenizer  # noqa: E402
from rlhf_core.training.stage_types import StageSite  # noqa: E402

RUNS = ("reward", "grpo", "ppo", "grpo-zero3", "grpo-lora", "dpo", "dpo-lora", "dpo-zero3", "grpo-unsynced")
KILLED = {"reward": "reward:step2:rank0", "grpo": "policy:step2:rank0"}  # after step 2, before its checkpoint
ONE_STEP = RUNS[2:-1]  # one process, one after another
UNSYNCED = "skip:policy:sync"  # grpo-unsynced's fault: no sync reaches the engine, which the stage must catch
# reward: 32 proxy pairs (4 steps of 8) and 8 audit pairs (1 step); DPO: 16 pairs (2 steps)
REWARD_PAIRS, DPO_PAIRS, EVAL_PAIRS, MICRO = 40, 16, 16, 8


def policy_dir(plan: Plan, out: Path, seed: int = 0) -> Path:
    """A random-weight Llama of the plan's shape on a tokenizer of the demo's sums, saved as a run saves one."""
    m = plan.model
    shape = ModelConfig(hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size"],
                        num_layers=m["num_hidden_layers"], num_heads=m["num_attention_heads"],
                        num_kv_heads=m["num_key_value_heads"])
    tok = train_tokenizer([f"{a:02d}+{b:02d}={a + b:03d}" for a in range(100) for b in range(100)], vocab_size=64)
    return save_pretrained_atomic(build_policy(shape, tok, seed=seed), tok, out)


def pairs(n: int, seed: int) -> list[dict]:
    """Preference pairs of the demo's task: the sum chosen, a near miss rejected."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        rows.append({"id": f"p{seed}-{i}", "prompt": prompt_for(a, b, 2), "chosen": answer_for(a + b, 2),
                     "rejected": answer_for(near_miss(a + b, rng), 2)})
    return rows


def offline_config(run: str, precision: str) -> PolicyConfig:
    return PolicyConfig(algorithm="dpo", num_workers=1, precision=precision, checkpoint_every=1, min_accuracy_gain=-1,
                        max_new_tokens=4, zero_stage=3 if run == "dpo-zero3" else 2,
                        lora={"enabled": run == "dpo-lora"}, gradient_checkpointing=run == "dpo-lora",
                        dpo={"epochs": 1, "batch_size": MICRO, "micro_batch_size": MICRO, "warmup_steps": 0,
                             "max_length": 16})


def rl_config(run: str, precision: str) -> PolicyConfig:
    return PolicyConfig(algorithm="ppo" if run == "ppo" else "grpo", num_workers=1, precision=precision,
                        steps=4 if run == "grpo" else 1, prompts_per_step=16 if run == "ppo" else 4,
                        grpo={"group_size": 4}, max_new_tokens=4, minibatch_size=16, micro_batch_size=8,
                        checkpoint_every=1, eval_every=2, min_accuracy_gain=-1, reward_model_weight=0.25,
                        verifiable_reward="addition_exact_match", verifiable_reward_weight=1.0,
                        zero_stage=3 if run == "grpo-zero3" else 2, lora={"enabled": run == "grpo-lora"},
                        gradient_checkpointing=run == "grpo-lora")


def run_stage(run: str, work: Path, sft: Path, precision: str, site: StageSite) -> dict:
    """One run's stage through its driver function -> its figures."""
    from rlhf_core.distributed import policy_rollouts  # noqa: PLC0415
    from rlhf_core.distributed.offline_trainer import train_offline  # noqa: PLC0415
    from rlhf_core.distributed.policy_trainer import train_policy  # noqa: PLC0415
    from rlhf_core.distributed.reward_trainer import train_reward_models  # noqa: PLC0415

    evals = pairs(EVAL_PAIRS, 2)
    if run == "reward":
        cfg = RewardConfig(num_workers=1, micro_batch_size=MICRO, epochs=1, checkpoint_every=1, warmup_steps=0,
                           precision=precision, min_eval_accuracy=0.0, audit_share=0.2, max_length=16)
        models = train_reward_models(pairs(REWARD_PAIRS, 1), evals, sft, cfg, site)
        return {name: {"eval_accuracy": r.eval_accuracy, "steps": r.steps, "attempts": r.run.attempts,
                       "resumed_from_step": r.run.resumed_from_step}
                for name, r in (("proxy", models.proxy), ("audit", models.audit))}
    eval_prompts, eval_answers = [r["prompt"] for r in evals[:4]], [r["chosen"] for r in evals[:4]]
    if run.startswith("dpo"):
        result = train_offline(pairs(DPO_PAIRS, 1), evals, eval_prompts, eval_answers, sft,
                               offline_config(run, precision), site)
        return {"policy": {"steps": result.steps, "kl": result.kl_final, "held_out": result.evaluations[-1],
                           "attempts": result.run.attempts}}
    policy_rollouts.open_engine = open_stand_in  # the engine's front door, where vLLM is not installed
    result = train_policy([r["prompt"] for r in pairs(32, 4)], eval_prompts, eval_answers, sft, work / "reward",
                          rl_config(run, precision), site)
    return {"policy": {"steps": result.steps, "attempts": result.run.attempts,
                       "resumed_from_step": result.run.resumed_from_step, "kl_max": result.kl_max,
                       "rm_score_after": result.rm_score_after, "audit_score_after": result.audit_score_after}}


def run(name: str, work: Path, plan: Plan, device: torch.device) -> dict:
    """One run on `device`, in this process's world of one (`train_context.one_process`: one process
    group a process, as a Ray Train worker has) -> its figures, the steps it logged and its peak GPU memory."""
    cuda = device.type == "cuda"
    precision = "bf16" if cuda else "fp32"
    sft = work / "sft"
    if not sft.exists():
        policy_dir(plan, sft)
    metrics = work / f"{name}-metrics.jsonl"
    site = StageSite(out_dir=work / name, storage_path=work / "runs", run_name=name, on_metrics=JsonlSink(metrics))
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    figures = run_stage(name, work, sft, precision, site)
    gib = 2**30
    return {"run": name, "device": device.type, "precision": precision, "seconds": time.perf_counter() - start,
            **figures, "steps_logged": [json.loads(line) for line in metrics.read_text().splitlines()],
            "peak_gpu_allocated_gib": torch.cuda.max_memory_allocated() / gib if cuda else None,
            "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / gib if cuda else None}


# ----------------------------------------------------------------------------- driven by gpu_check

LOSS = {"reward": "reward/loss", "grpo": "policy/pg_loss"}  # the figure a redone step must repeat


def run_process(runs: list[str], work: Path, dry_run: bool, fault: str | None = None) -> dict:
    """`bench/gpu_loops.py RUNS...` in a process of its own (with $RLHF_FAULT=`fault`) -> its exit
    status, seconds, the tail of its output and, by run, the figures each run wrote."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("RLHF_FAULT", None)
    if fault:
        env["RLHF_FAULT"] = fault
    cmd = [sys.executable, str(REPO / "bench" / "gpu_loops.py"), *runs, "--work", str(work), *(["--dry-run"] * dry_run)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results = {r: json.loads((work / f"{r}.json").read_text()) for r in runs if (work / f"{r}.json").exists()}
    return {"returncode": proc.returncode, "seconds": time.perf_counter() - start, "fault": fault,
            "output_tail": proc.stdout[-3000:], "results": results}


def killed_and_resumed(name: str, work: Path, dry_run: bool) -> tuple[dict, dict[str, bool]]:
    """`name` killed after step 2, then run again -> (both processes and the logged losses, the checks)."""
    killed = run_process([name], work, dry_run, fault=f"kill:{KILLED[name]}")
    resumed = run_process([name], work, dry_run)
    figures = resumed["results"].get(name, {})
    first = figures.get("proxy", figures.get("policy", {}))
    logged = [json.loads(line) for line in (work / f"{name}-metrics.jsonl").read_text().splitlines()] \
        if (work / f"{name}-metrics.jsonl").exists() else []
    losses = [(m["step"], m[LOSS[name]]) for m in logged if LOSS[name] in m]
    redone = [loss for step, loss in losses if step == 2]
    checks = {"killed by the fault (SIGKILL)": killed["returncode"] == -9 and name not in killed["results"],
              "resumed from step 1 in a second attempt":
                  (first.get("resumed_from_step"), first.get("attempts")) == (1, 2),
              "step 2 redone with the same loss": len(redone) == 2 and math.isclose(*redone, rel_tol=1e-3),
              "the run finished": resumed["returncode"] == 0 and bool(figures)}
    return {"killed": killed, "resumed": resumed, "step_losses": losses}, checks


def run_loops(dry_run: bool, done) -> tuple[dict, list[str]]:
    """The worker loops in order (`RUNS`), each recorded with `done` as it ends -> (results, failures)."""
    results, failed = {}, []
    with tempfile.TemporaryDirectory(prefix="gpu-check-loops-") as tmp:
        work = Path(tmp)
        for name in KILLED:
            results[name], checks = killed_and_resumed(name, work, dry_run)
            results[name]["checks"] = checks
            failed += [f"{name}: {check} does not hold" for check, held in checks.items() if not held]
            if results[name]["resumed"]["returncode"]:
                failed.append(f"{name}: exited {results[name]['resumed']['returncode']}:\n"
                              f"{results[name]['resumed']['output_tail']}")
            resumed = results[name]["resumed"]["results"].get(name)
            _print_run(f"{name}, killed after step 2 and resumed", resumed, checks)
            done(f"{name} loop", loops=results)
        one_step = run_process(list(ONE_STEP), work, dry_run)
        for name in ONE_STEP:
            results[name] = one_step["results"].get(name)
            _print_run(name, results[name], {})
        if one_step["returncode"] or len(one_step["results"]) < len(ONE_STEP):
            failed.append(f"{', '.join(ONE_STEP)}: exited {one_step['returncode']} after "
                          f"{', '.join(one_step['results']) or 'none'}:\n{one_step['output_tail']}")
        done("one-step loops", loops=results)
        stale = run_process(["grpo-unsynced"], work, dry_run, fault=UNSYNCED)
        caught = stale["returncode"] != 0 and "weight sync failed" in stale["output_tail"]
        results["grpo-unsynced"] = {"returncode": stale["returncode"], "caught": caught,
                                    "said": list(dict.fromkeys(line.split("]:")[-1].strip() for line in
                                                               stale["output_tail"].splitlines() if "check:" in line))}
        print(f"grpo-unsynced, no sync reaching the engine: {'stopped at the check' if caught else 'NOT CAUGHT'}"
              + "".join(f"\n  {line}" for line in results["grpo-unsynced"]["said"]), flush=True)
        failed += [] if caught else [f"grpo-unsynced: a sync that never reached the engine went unnoticed "
                                     f"(exit {stale['returncode']}):\n{stale['output_tail']}"]
        done("unsynced loop", loops=results)
    return results, failed


def _print_run(label: str, r: dict | None, checks: dict) -> None:
    held = "".join(f"; {name}: {'yes' if ok else 'NO'}" for name, ok in checks.items())
    if r is None:
        print(f"{label}: FAILED{held}", flush=True)
        return
    memory = "" if r["peak_gpu_allocated_gib"] is None else (
        f", peak GPU memory {r['peak_gpu_allocated_gib']:.2f} GiB allocated, {r['peak_gpu_reserved_gib']:.2f} reserved")
    syncs = [m["rollout/sync_s"] for m in r["steps_logged"] if "rollout/sync_s" in m]
    diffs = [m["rollout/prob_diff"] for m in r["steps_logged"] if "rollout/prob_diff" in m]
    sync = f", syncs {max(syncs):.2f} s at most, rollout/prob_diff {max(diffs):.2e} at most" if syncs and diffs else ""
    free = [m["rollout/free_at_wake_gib"] for m in r["steps_logged"] if "rollout/free_at_wake_gib" in m]
    sync += f", {min(free):.1f} GiB free at the engine's wake at least" if free else ""
    print(f"{label}: {r['seconds']:.1f} s on {r['device']} in {r['precision']}{memory}{sync}{held}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", choices=RUNS, help="one after another in this process")
    parser.add_argument("--work", type=Path, required=True, help="the runs' shared directory (grpo reads reward's)")
    parser.add_argument("--dry-run", action="store_true", help="the CPU with a tiny model, even where CUDA is")
    args = parser.parse_args()
    dry_run = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry_run else "cuda")
    with train_context.one_process(args.work / "runs", use_gpu=device.type == "cuda"):
        for name in args.runs:
            result = run(name, args.work, DRY_PLAN if dry_run else GPU_PLAN, device)
            (args.work / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
