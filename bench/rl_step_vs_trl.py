"""RL step throughput: our GRPO (Ray Train + DeepSpeed workers, rollouts from the vLLM
engine) against TRL's `GRPOTrainer`, on the same policy, prompts, reward, group size,
completion length and number of optimizer updates per step, in one run.

Settings shared by both sides: a Llama policy of the chosen size (random weights), the
demo's addition prompts, the verifiable exact-match reward only, 32 prompts x 8 samples =
256 completions per step of at most `--tokens` tokens at temperature 1, one optimizer update
per step (AdamW, lr 1e-5, KL coefficient 0.02 to a frozen reference), float32 on the CPU.
Ours runs 2 workers (one per core); TRL one process with as many torch threads as cores
(TRL's CPU path, generation with Hugging Face `generate`). Throughput is completions per
second of step wall time, median over the steps after the first (warm-up).

TRL is installed by this script into its own virtual environment (`--trl-venv`, default
/tmp/rlhf-bench-trl), so its dependency pins never touch the project's.

    .venv/bin/python bench/rl_step_vs_trl.py --size 25m
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import RESULTS, SIZES, save, table  # noqa: E402
from bench.rollout_generation import demo_tokenizer  # noqa: E402
from rlhf_core.testing.sinks import JsonlSink  # noqa: E402
from rlhf_core.config import ModelConfig, PolicyConfig  # noqa: E402
from rlhf_core.data.synthetic import answer_for, prompt_for  # noqa: E402
from rlhf_core.models.llama import build_policy, num_parameters, save_pretrained_atomic  # noqa: E402

HERE = Path(__file__).resolve().parent
PROMPTS_PER_STEP, GROUP, LR, KL = 32, 8, 1e-5, 0.02


def trl_python(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        # torch first, pinned to the project's build so both sides run the same kernels
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "torch==2.13.0", "trl", "datasets"], check=True)
    return python


def ours(model_dir: Path, prompts: list[str], steps: int, tokens: int, tmp: Path) -> dict:
    from rlhf_core.distributed.policy_trainer import train_policy  # noqa: PLC0415
    from rlhf_core.training.stage_types import StageSite  # noqa: PLC0415

    cfg = PolicyConfig(
        algorithm="grpo", num_workers=2, precision="fp32", steps=steps, prompts_per_step=PROMPTS_PER_STEP,
        grpo={"group_size": GROUP},
        max_new_tokens=tokens, epochs_per_step=1, minibatch_size=PROMPTS_PER_STEP * GROUP, micro_batch_size=64,
        learning_rate=LR, kl_coef=KL, reward_model_weight=0.0, verifiable_reward_weight=1.0,
        verifiable_reward="addition_exact_match",
        eval_every=steps, checkpoint_every=steps, kl_bound=1e6,
    )
    eval_prompts = prompts[:8]
    answers = [answer_for(int(p[:2]) + int(p[3:5]), 2) for p in eval_prompts]
    sink = JsonlSink(tmp / "ours.jsonl")
    result = train_policy(prompts, eval_prompts, answers, model_dir, None, cfg,
                          StageSite(tmp / "policy", tmp / "ray", "bench", sink))
    rows = [json.loads(line) for line in Path(sink.path).read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    step_s = [max(v for k, v in r.items() if k.startswith("policy/step_time_s/worker_")) for r in steps]
    steady = steps[1:] or steps  # where a step's time goes, as the median step
    phases = {k.removeprefix("timing/"): statistics.median(r[k] for r in steady) for k in steady[0] if k.startswith("timing/")}
    return {"step_s": step_s, "fit_s": result.run.seconds, "phase_s": phases,
            "response_length": [r["policy/response_length"] for r in steps]}


def matmul_parameters(model) -> int:
    """Weights of the matrix multiplies a token goes through (every Linear, the LM head
    included; not the embedding lookup or the norms)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def floor_seconds(model, prompt_tokens: float, response_tokens: float, peak_gflop_per_s: float) -> dict:
    """The least time one GRPO step can take on this CPU: its matrix-multiply FLOPs at the peak
    fp32 throughput `compute_bound.py` measured. 2 FLOPs per weight per token for each forward
    pass, 6 for forward + backward. Per completion: generating its tokens, the reference
    model's forward pass over prompt + completion, and the update's forward and backward (whose
    forward also gives pi_old's logprobs). Attention's own FLOPs (under 3% at these lengths),
    the optimizer and everything else are left out, so the true floor is higher."""
    n, completions = matmul_parameters(model), PROMPTS_PER_STEP * GROUP
    sequence = prompt_tokens + response_tokens
    flops = completions * (2 * n * response_tokens + 2 * n * sequence + 6 * n * sequence)
    return {"tflop": flops / 1e12, "floor_s": flops / (peak_gflop_per_s * 1e9)}


def trl(python: Path, model_dir: Path, prompts: list[str], steps: int, tokens: int, tmp: Path) -> dict:
    spec = {"model_dir": str(model_dir), "prompts": prompts, "steps": steps, "tokens": tokens, "group_size": GROUP,
            "completions_per_step": PROMPTS_PER_STEP * GROUP, "micro_batch": 64, "learning_rate": LR,
            "kl_coef": KL, "threads": os.cpu_count() or 1, "out_dir": str(tmp / "trl")}
    done = subprocess.run([str(python), str(HERE / "trl_side.py"), json.dumps(spec)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"TRL side failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="25m", choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--trl-venv", type=Path, default=Path("/tmp/rlhf-bench-trl"))
    args = parser.parse_args()
    python = trl_python(args.trl_venv)
    tok = demo_tokenizer()
    prompts = [prompt_for(a, b, 2) for a in range(16) for b in range(16)]  # 256 distinct prompts
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_policy(ModelConfig(**SIZES[args.size], max_position_embeddings=args.tokens + 16), tok, seed=0)
        model_dir = save_pretrained_atomic(model, tok, tmp / "policy0")
        theirs = trl(python, model_dir, prompts, args.steps, args.tokens, tmp)
        mine = ours(model_dir, prompts, args.steps, args.tokens, tmp)
    completions = PROMPTS_PER_STEP * GROUP
    prompt_tokens = statistics.mean(len(tok(p)["input_ids"]) for p in prompts)
    bound = json.loads((RESULTS / "compute_bound.json").read_text()) if (RESULTS / "compute_bound.json").exists() else None
    rows = []
    for name, res in (("TRL GRPOTrainer " + theirs["trl"], theirs), ("ours (Ray+DeepSpeed+vLLM)", mine)):
        steady = res["step_s"][1:] or res["step_s"]
        step_s, length = statistics.median(steady), statistics.mean(res["response_length"])
        row = {"side": name, "steps": len(res["step_s"]), "median_step_s": step_s,
               "samples_per_s": completions / step_s, "tokens_per_s": completions * length / step_s,
               "response_length": length}
        if bound:
            floor = floor_seconds(model, prompt_tokens, length, bound["peak_gflop_per_s"])
            row |= {**floor, "of_peak": floor["floor_s"] / step_s}
        rows.append(row)
    ratio = rows[1]["samples_per_s"] / rows[0]["samples_per_s"]
    print(f"\nGRPO step throughput, {args.size} policy ({num_parameters(model):,} parameters), "
          f"{PROMPTS_PER_STEP}x{GROUP} completions of <= {args.tokens} tokens, 1 update per step:")
    print(table(rows, ["side", "steps", "median_step_s", "samples_per_s", "tokens_per_s", "response_length",
                       "tflop", "floor_s", "of_peak"]))
    print(f"ours / TRL: {ratio:.2f}x")
    if bound:
        print(f"floor_s: the step's matrix-multiply FLOPs (tflop) at this CPU's measured peak, "
              f"{bound['peak_gflop_per_s']:.0f} GFLOP/s (compute_bound.py); of_peak = floor_s / step. "
              f"1.5x TRL would be a {rows[0]['median_step_s'] / 1.5:.1f} s step.")
    else:
        print("run bench/compute_bound.py first for each side's floor at this CPU's peak")
    print("ours, median seconds per phase of a step (rank 0): "
          + ", ".join(f"{k} {v:.2f}" for k, v in mine["phase_s"].items()))
    path = save(f"rl_step_vs_trl_{args.size}", {"size": args.size, "params": num_parameters(model), "rows": rows,
                                                 "ratio": ratio, "raw": {"trl": theirs, "ours": mine}})
    print(f"written {path}")


if __name__ == "__main__":
    main()
