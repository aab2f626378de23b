"""Pipelined rollouts (`policy.pipeline.max_lag` > 0) against the synchronous loop, on the demo.

Both modes start from the same demo run's SFT policy and reward model (the newest
`runs/demo-*`, or `--run-dir`), with configs/demo.yaml's policy settings, the same prompts and
the same seeds; only `policy.pipeline` differs. Per run it reports the wall time of training
(`fit_s`: engine start and evaluations included, the same work in both modes), RL steps per
minute and samples per second over the step loop alone, and what was learned: held-out
exact match before and after, the mean reward of the last 5 steps, the exact-match share of
the last 10 steps' samples, the largest KL. Then, per mode, the mean and spread over seeds.

    make demo                                   # once, for the SFT policy and reward model
    .venv/bin/python bench/pipelined.py         # seeds 0-3, max_lag 1
    .venv/bin/python bench/pipelined.py --learning-rate 2e-4    # the earlier default, for comparison
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import NO_DEMO_RUN, REPO, demo_policy_inputs, newest_demo_run, save, table  # noqa: E402
from rlhf_core.config import RolloutPipelineConfig, load_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, default=None, help="a demo run (default: the newest)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--max-lag", type=int, default=1)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: the demo's)")
    parser.add_argument("--num-workers", type=int, default=None, help="Ray Train workers (default: the demo's)")
    parser.add_argument("--learning-rate", type=float, default=None, help="policy learning rate (default: the demo's)")
    args = parser.parse_args()
    from rlhf_core.distributed.policy_trainer import train_policy  # noqa: PLC0415 (spawn: under __main__)
    from rlhf_core.training.stage_types import StageSite  # noqa: PLC0415

    run_dir = args.run_dir or newest_demo_run()
    if run_dir is None:
        raise SystemExit(NO_DEMO_RUN)
    cfg = load_config(REPO / "configs" / "demo.yaml").policy
    if args.steps:
        cfg = cfg.model_copy(update={"steps": args.steps, "eval_every": args.steps})
    if args.num_workers:
        cfg = cfg.model_copy(update={"num_workers": args.num_workers})
    if args.learning_rate:
        cfg = cfg.model_copy(update={"learning_rate": args.learning_rate})
    prompts, eval_prompts, eval_answers = demo_policy_inputs(run_dir)
    modes = {"sync": RolloutPipelineConfig(),
             f"pipelined (max_lag {args.max_lag})": RolloutPipelineConfig(max_lag=args.max_lag, chunks=args.chunks)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for mode, pipeline in modes.items():
                run_cfg = cfg.model_copy(update={"seed": seed, "pipeline": pipeline})
                name = f"{'pipe' if pipeline.max_lag else 'sync'}-{seed}"
                r = train_policy(prompts, eval_prompts, eval_answers, run_dir / "models" / "sft",
                                 run_dir / "models" / "reward", run_cfg,
                                 StageSite(Path(tmp) / name, Path(tmp) / "ray", name))
                hist = r.run.metrics_history
                loop_s = sum(max(v for k, v in m.items() if k.startswith("policy/step_time_s/")) for m in hist)
                last = hist[-5:]
                rows.append({
                    "mode": mode, "seed": seed, "workers": cfg.num_workers, "steps": r.steps, "fit_s": r.run.seconds,
                    "loop_s": loop_s, "steps_per_min": 60 * r.steps / loop_s,
                    "samples_per_s": r.steps * cfg.rollouts_per_step / loop_s,
                    "generate_s": sum(m["timing/generate"] for m in hist) / len(hist),
                    "update_s": sum(m["timing/update"] for m in hist) / len(hist),
                    "lag_mean": sum(m.get("pipeline/lag_mean", 0.0) for m in hist) / len(hist),
                    "accuracy_before": r.accuracy_before, "accuracy_after": r.accuracy_after,
                    "reward_last5": sum(m["policy/reward_mean"] for m in last) / len(last),
                    # exact-match share of the last 10 steps' samples: 2,560 samples, less noisy
                    # than one held-out evaluation of the final weights
                    "verifiable_last10": float(np.mean([m["policy/verifiable_reward_mean"] for m in hist[-10:]])),
                    "kl_max": r.kl_max,
                })
                print(table(rows[-1:], list(rows[-1])), flush=True)
    print(f"\nPipelined vs synchronous rollouts on the demo ({run_dir.name}), {cfg.steps} GRPO steps of "
          f"{cfg.rollouts_per_step} samples, learning rate {cfg.learning_rate:g}:")
    print(table(rows, ["mode", "seed", "workers", "fit_s", "samples_per_s", "generate_s", "update_s", "lag_mean",
                       "accuracy_before", "accuracy_after", "reward_last5", "verifiable_last10", "kl_max"]))
    for seed in args.seeds:
        sync, pipe = [r for r in rows if r["seed"] == seed]
        print(f"seed {seed}: pipelined/sync samples/s {pipe['samples_per_s'] / sync['samples_per_s']:.2f}x, "
              f"fit time {pipe['fit_s'] / sync['fit_s']:.2f}x, accuracy after {pipe['accuracy_after']:.3f} vs "
              f"{sync['accuracy_after']:.3f}")
    summary = summarise(rows)
    print("\nOver the seeds (mean, sample standard deviation):")
    print(table(summary, list(summary[0])))
    name = "pipelined" + ("" if cfg.num_workers == 2 else f"_{cfg.num_workers}w") + (f"_lr{args.learning_rate:g}" if args.learning_rate else "")
    print(f"\nwritten {save(name, {'run_dir': run_dir.name, 'max_lag': args.max_lag, 'chunks': args.chunks, 'learning_rate': cfg.learning_rate, 'rows': rows, 'summary': summary})}")


def summarise(rows: list[dict]) -> list[dict]:
    """Per mode: mean and sample standard deviation over the seeds of what was learned, and
    the mean throughput. One seed's held-out accuracy after 30 steps moves by several points
    from run to run, so the comparison is of means over seeds, with their spread."""
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        runs = [r for r in rows if r["mode"] == mode]
        sd = (lambda k: float(np.std([r[k] for r in runs], ddof=1))) if len(runs) > 1 else (lambda k: float("nan"))
        out.append({"mode": mode, "seeds": len(runs),
                    "samples_per_s": float(np.mean([r["samples_per_s"] for r in runs])),
                    "accuracy_after": float(np.mean([r["accuracy_after"] for r in runs])), "accuracy_sd": sd("accuracy_after"),
                    "verifiable_last10": float(np.mean([r["verifiable_last10"] for r in runs])),
                    "verifiable_sd": sd("verifiable_last10")})
    return out


if __name__ == "__main__":
    main()
