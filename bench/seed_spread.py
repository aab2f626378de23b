"""The demo's recipe over seeds, kernel paths and thread counts: does every row get through the gates?

Runs the demo's SFT, reward-model and policy stages (configs/demo.yaml, the rlhf_core entry
points the pipeline's tasks call, without Prefect or MLflow) and its promotion gates (regression
suites included) once per seed, CPU kernel path and torch thread count, on the demo's data
(generated once: the data seed stays the demo's). The seed is set for every stage (`sft.seed`,
`reward.seed`, `policy.seed`); the thread count applies to this process, where SFT and its
held-out evaluation run (the Ray workers of the reward and policy stages use one thread each
whatever it is). A different thread count changes the order in which the kernels sum, and a
kernel path (`KERNEL_PATHS`: the ISA that ATen, oneDNN and MKL may use, set in the environment
of a child process per path, Ray's workers included) changes the kernels themselves: both stand
in for another CPU, so one machine tries the numerics of the others.

Per row: SFT steps and the step at which it reached the no-carry plateau (the running loss
within `PLATEAU_MARGIN` nats of the floor that the corpus's own label noise sets), the base
policy's held-out accuracy, the policy's after RL, the gain, wall time per stage, and whether
the row met every bar the demo config sets (`sft.min_eval_accuracy`, the plateau by
`MAX_PLATEAU_SHARE` of the SFT budget, `reward.min_eval_accuracy`,
`policy.min_accuracy_gain`, and the promotion gates against the SFT policy). The stages run
with their own bars off, so a row that misses one still reports every figure.

    .venv/bin/python bench/seed_spread.py                      # seeds 0-7 x threads 1, 2: about an hour
    .venv/bin/python bench/seed_spread.py --seeds 0 1 --threads 2 1 --kernel-paths native avx2 mkl_avx2 \
        --name seed_spread_kernels                             # 12 rows over 3 kernel paths
    .venv/bin/python bench/seed_spread.py --threads 2 1 --sft-only-threads 1   # RL stages at 2 threads only
    .venv/bin/python bench/seed_spread.py --seeds 0 1 --threads 2 --sft-only
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import REPO, RESULTS, gates_vs_reference, save, table  # noqa: E402
from rlhf_core.config import PipelineConfig, load_config  # noqa: E402
from rlhf_core.data.schema import read_table  # noqa: E402
from rlhf_core.data.synthetic import DemoFiles, generate_demo_data, has_carry  # noqa: E402
from rlhf_core.eval.regression import load_suites  # noqa: E402
from rlhf_core.training.base_policy import make_base_policy  # noqa: E402

# The plateau: the SFT loss within this many nats per token of the corpus's noise floor.
PLATEAU_MARGIN = 0.1
# A seed has margin when it reaches the plateau by this share of the SFT budget.
MAX_PLATEAU_SHARE = 0.6
LOSS_WINDOW = 5  # logged losses (every 10 steps) averaged for the plateau test
# A kernel path: the environment that caps the ISA of ATen's kernels, oneDNN's and MKL's
# (`native`: what this CPU picks; `mkl_avx2`: MKL's AVX2 matmuls beside ATen's own kernels). Set
# before torch is imported, so each runs in a child process. ATen's scalar kernels
# (ATEN_CPU_CAPABILITY=default) are no path here: vLLM's CPU backend compiles its kernels for AVX2
# or better and fails at the engine's first generate.
KERNEL_PATHS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl_avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
}


def noise_floor(sft_rows: list[dict], wrong_share: float) -> float:
    """The lowest mean per-token loss a policy can reach on the demo's SFT corpus.

    On a carry problem the corpus answers without the carry in `wrong_share` of its rows, so
    the best policy spreads its probability the same way and pays the binary entropy
    H(wrong_share) once per such answer (at the first digit where the two answers differ);
    every other answer token is certain. Per labelled token (the answer's digits and `</s>`),
    that is H x share of carry problems / tokens per answer."""
    if not 0 < wrong_share < 1:
        return 0.0
    h = -(wrong_share * math.log(wrong_share) + (1 - wrong_share) * math.log(1 - wrong_share))
    carries = sum(has_carry(*operands(r["prompt"])) for r in sft_rows) / len(sft_rows)
    tokens = len(sft_rows[0]["completion"]) + 1
    return h * carries / tokens


def operands(prompt: str) -> tuple[int, int]:
    a, b = prompt.rstrip("=").split("+")
    return int(a), int(b)


def plateau_step(history: list[tuple[int, float]], threshold: float, window: int = LOSS_WINDOW) -> int | None:
    """The first logged step at which the mean of the last `window` losses is at most `threshold`."""
    for i in range(window - 1, len(history)):
        if statistics.fmean(loss for _, loss in history[i - window + 1 : i + 1]) <= threshold:
            return history[i][0]
    return None


def run_seed(cfg: PipelineConfig, files: DemoFiles, seed: int, threads: int, work: Path, sft_only: bool) -> dict:
    from rlhf_core.data.pairs import split_by_prompt  # noqa: PLC0415
    from rlhf_core.distributed.policy_trainer import train_policy  # noqa: PLC0415
    from rlhf_core.distributed.reward_trainer import train_reward_models  # noqa: PLC0415
    from rlhf_core.training.stage_types import StageSite  # noqa: PLC0415

    torch.set_num_threads(threads)
    sft_cfg = cfg.sft.model_copy(update={"seed": seed, "min_eval_accuracy": 0.0})
    reward_cfg = cfg.reward.model_copy(update={"seed": seed, "min_eval_accuracy": 0.0})
    policy_cfg = cfg.policy.model_copy(update={"seed": seed, "min_accuracy_gain": -1.0})
    run_cfg = cfg.model_copy(update={"sft": sft_cfg})
    sft_rows = read_table(files.sft).to_dict("records")
    pairs = read_table(files.preferences).to_dict("records")
    evals = read_table(files.eval)
    history: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    base = make_base_policy(
        [r["prompt"] for r in sft_rows], [r["completion"] for r in sft_rows],
        [r["prompt"] + r["completion"] for r in sft_rows] + [p["prompt"] + p["chosen"] for p in pairs],
        list(evals["prompt"]), list(evals["answer"]), run_cfg, work / "sft",
        on_metrics=lambda step, m: history.append((step, m["sft/loss"])),
    )
    sft_s = time.perf_counter() - t0
    floor = noise_floor(sft_rows, cfg.data.demo.wrong_share)
    plateau = plateau_step(history, floor + PLATEAU_MARGIN)
    row = {"seed": seed, "threads": threads, "kernel_path": os.environ.get("SEED_SPREAD_KERNEL_PATH", "native"),
           "aten_capability": torch.backends.cpu.get_cpu_capability(), "stages": "sft" if sft_only else "all",
           "sft_steps": base.sft_steps, "sft_plateau_step": plateau,
           "sft_plateau_share": plateau / base.sft_steps if plateau else None, "sft_final_loss": base.sft_final_loss,
           "loss_floor": floor, "base_accuracy": base.eval_accuracy, "sft_s": sft_s}
    if not sft_only:
        train, held_out = split_by_prompt(pairs, reward_cfg.eval_share, reward_cfg.seed)
        t0 = time.perf_counter()
        reward = train_reward_models(train, held_out, base.path, reward_cfg,
                                     StageSite(work / "reward", work / "ray", f"reward-{seed}-{threads}"))
        row.update(reward_accuracy=reward.proxy.eval_accuracy, reward_s=time.perf_counter() - t0,
                   audit_accuracy=reward.audit.eval_accuracy if reward.audit else None)
        prompts = list(dict.fromkeys([r["prompt"] for r in sft_rows] + [p["prompt"] for p in pairs]))
        t0 = time.perf_counter()
        policy = train_policy(prompts, list(evals["prompt"]), list(evals["answer"]), base.path, reward.proxy.path,
                              policy_cfg, StageSite(work / "policy", work / "ray", f"policy-{seed}-{threads}"),
                              replay_pairs=pairs)
        row.update(final_accuracy=policy.accuracy_after, gain=policy.accuracy_gain, kl_max=policy.kl_max,
                   policy_s=time.perf_counter() - t0, labels=reward.proxy_pairs + reward.audit_pairs
                   + policy.labels_asked)
        suites = load_suites(cfg.gates.regression_suites, work / "suites", cfg.data.demo, list(evals["prompt"]))
        decision, evaluated = gates_vs_reference(cfg, policy.path, base.path, reward.proxy.path, list(evals["prompt"]),
                                                 list(evals["answer"]), seed, suites)
        figures = evaluated.candidate.figures
        row.update(gate_passed=decision.passed, gate_status=decision.status, verdict=decision.status.upper(),
                   gate_reasons="; ".join(decision.reasons or decision.undecided) or None,
                   eval_looks=[(look.rows, list(look.open), look.stopped) for look in evaluated.looks],
                   regression={s.name: {"accuracy": s.accuracy, "looks": [(look.rows, look.vs_reference["estimate"],
                                                                           look.vs_reference["low"], look.stopped)
                                                                          for look in s.looks]}
                               for s in figures.regression})
    row["wall_s"] = row["sft_s"] + row.get("reward_s", 0.0) + row.get("policy_s", 0.0)
    row["failure"] = failure(row, cfg, sft_only)
    row["success"] = row["failure"] is None
    return row


def failure(row: dict, cfg: PipelineConfig, sft_only: bool) -> str | None:
    """The first of the demo's bars that the row missed, in the words of the stage it stops; None if none."""
    if row["sft_plateau_share"] is None or row["sft_plateau_share"] > MAX_PLATEAU_SHARE:
        return f"sft: no plateau by {MAX_PLATEAU_SHARE:.0%} of {row['sft_steps']} steps"
    if row["base_accuracy"] < cfg.sft.min_eval_accuracy:
        return f"sft: held-out accuracy {row['base_accuracy']:.3f} < sft.min_eval_accuracy={cfg.sft.min_eval_accuracy}"
    if sft_only:
        return None
    if row["reward_accuracy"] < cfg.reward.min_eval_accuracy:
        return f"reward: held-out accuracy {row['reward_accuracy']:.3f} < reward.min_eval_accuracy={cfg.reward.min_eval_accuracy}"
    if row["gain"] < cfg.policy.min_accuracy_gain:
        return f"policy: gain {row['gain']:+.3f} < policy.min_accuracy_gain={cfg.policy.min_accuracy_gain}"
    if not row["gate_passed"]:
        return f"gates: {row['gate_reasons']}"
    return None


def summarise(rows: list[dict]) -> dict:
    def spread(key: str) -> dict | None:
        xs = [r[key] for r in rows if r.get(key) is not None]
        if not xs:
            return None
        return {"mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0,
                "min": min(xs), "max": max(xs)}

    return {"rows": len(rows), "successes": sum(r["success"] for r in rows),
            **{k: spread(k) for k in ("sft_plateau_share", "base_accuracy", "reward_accuracy", "final_accuracy",
                                      "gain", "sft_s", "wall_s")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "demo.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--seeds", nargs="*", type=int, default=list(range(8)), help="none: only --merge")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--sft-only", action="store_true", help="SFT and its held-out accuracy only (minutes, not an hour)")
    parser.add_argument("--sft-only-threads", nargs="*", type=int, default=[], metavar="T",
                        help="thread counts run through SFT only: the count reaches no other stage's process")
    parser.add_argument("--merge", type=Path, action="append", default=[], metavar="JSON",
                        help="also report the rows of another result file of this script (a split or interrupted run)")
    parser.add_argument("--name", default="seed_spread", help="result file name under bench/results/")
    parser.add_argument("--kernel-paths", nargs="*", default=[], choices=sorted(KERNEL_PATHS),
                        help="run the rows once per kernel path, each in a child process, and merge them")
    args = parser.parse_args()
    if args.kernel_paths:
        args.merge += [run_kernel_path(path, args) for path in args.kernel_paths]
        args.seeds = []
    cfg = load_config(args.config, args.overrides)
    rows: list[dict] = [merged(row, cfg) for path in args.merge for row in json.loads(path.read_text())["rows"]]
    columns = ["kernel_path", "seed", "threads", "stages", "sft_steps", "sft_plateau_step", "sft_plateau_share", "base_accuracy",
               "reward_accuracy", "final_accuracy", "gain", "labels", "sft_s", "wall_s", "verdict", "success", "failure"]
    with tempfile.TemporaryDirectory(prefix="seed-spread-") as tmp:
        files = generate_demo_data(cfg.data.demo, Path(tmp) / "data")
        only_sft = args.sft_only or set(args.threads) <= set(args.sft_only_threads) or not args.seeds
        ctx = contextlib.nullcontext() if only_sft else _ray_session()
        with ctx:
            for threads in args.threads:
                for seed in args.seeds:
                    sft_only = args.sft_only or threads in args.sft_only_threads
                    rows.append(run_seed(cfg, files, seed, threads, Path(tmp) / f"s{seed}-t{threads}", sft_only))
                    print(table(rows[-1:], columns), flush=True)
                    write(args, rows)  # a long run interrupted keeps the rows it finished
    summary = write(args, rows)
    print(f"\nThe demo recipe ({args.config.name}{' ' + ' '.join(args.overrides) if args.overrides else ''}), "
          f"{len(rows)} runs:")
    print(table(rows, columns))
    print(f"\n{summary['successes']} of {summary['rows']} met every bar")
    for key in ("sft_plateau_share", "base_accuracy", "final_accuracy", "gain", "wall_s"):
        s = summary[key]
        if s:
            print(f"  {key:<18} mean {s['mean']:.3f}  sd {s['sd']:.3f}  min {s['min']:.3f}  max {s['max']:.3f}")
    print(f"\nwritten {RESULTS / (args.name + '.json')}")


def run_kernel_path(path: str, args: argparse.Namespace) -> Path:
    """This script on `args`' seeds and threads in a child process whose environment caps the
    kernels at `path`; -> its result file (bench/results/<name>_<path>.json)."""
    name = f"{args.name}_{path}"
    command = [sys.executable, __file__, "--config", str(args.config), "--name", name, "--seeds",
               *map(str, args.seeds), "--threads", *map(str, args.threads),
               *(["--sft-only"] if args.sft_only else []), *(f"--set={o}" for o in args.overrides)]
    env = {**os.environ, **KERNEL_PATHS[path], "SEED_SPREAD_KERNEL_PATH": path}
    subprocess.run(command, env=env, check=True)
    return RESULTS / f"{name}.json"


def write(args: argparse.Namespace, rows: list[dict]) -> dict:
    summary = summarise(rows)
    save(args.name, {"cpu_flags": cpu_flags(),
                     "config": str(args.config.relative_to(REPO) if args.config.is_relative_to(REPO) else args.config),
                     "overrides": args.overrides, "plateau_margin": PLATEAU_MARGIN,
                     "max_plateau_share": MAX_PLATEAU_SHARE, "rows": rows, "summary": summary})
    return summary


def cpu_flags() -> list[str]:
    """The flags that choose between the kernels (AVX-512 with bf16, AMX), as /proc/cpuinfo lists them."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return sorted(f for f in set(flags) if f.startswith("amx") or f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16"))


def merged(row: dict, cfg: PipelineConfig) -> dict:
    """A row of another result file, judged again against this config's bars (the stages ran
    with their own bars off, so the figures do not depend on them). Files written before rows
    named their stages ran all of them exactly when they have a reward-model figure."""
    row = {"stages": "all" if row.get("reward_accuracy") is not None else "sft", **row}
    row["failure"] = failure(row, cfg, row["stages"] == "sft")
    row["success"] = row["failure"] is None
    return row


def _ray_session():
    from rlhf_core.distributed.cluster import ray_session  # noqa: PLC0415

    return ray_session()


if __name__ == "__main__":
    main()
