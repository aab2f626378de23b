"""Print the latest benchmark results (bench/results/*.json) as the README's markdown tables."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS  # noqa: E402


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _md(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(format(r[key], fmt) if fmt else str(r[key]) for key, _, fmt in columns) + " |")
    return "\n".join(lines)


def main() -> None:
    machine = None
    out = []
    if (r := _load("rollout_generation")) is not None:
        machine = r["machine"]
        out += [f"**Rollout generation** ({r['group']} samples per prompt, {r['tokens']} tokens each, tokens/s):", "",
                _md(r["rows"], [("size", "policy", ""), ("params", "parameters", ","), ("completions", "completions", ""),
                                ("hf_tokens_per_s", "HF generate", ",.0f"), ("ours_tokens_per_s", "our engine", ",.0f"),
                                ("speedup", "ours / HF", ".2f")]), ""]
    if (r := _load("weight_sync")) is not None:
        machine = machine or r["machine"]
        out += [f"**Weight sync** (share of one step of {r['prompts']} prompts × 8 samples × {r['tokens']} tokens "
                "plus a train pass):", "",
                _md(r["rows"], [("size", "policy", ""), ("params", "parameters", ","), ("MB", "MB", ".0f"),
                                ("sync_s", "sync s", ".3f"), ("step_s", "step s", ".2f"), ("sync_share", "share", ".1%")]), ""]
        if (real := r.get("real_demo")) is not None:
            out += [f"The trainer's own demo GRPO step (`timing/sync` against the step's wall time, median of "
                    f"{real['steps']} steps): sync {real['sync_s'] * 1e3:.0f} ms of {real['step_s']:.2f} s = "
                    f"**{real['sync_share']:.1%}**.", ""]
    for name in ("rl_step_vs_trl_demo", "rl_step_vs_trl_25m"):
        if (r := _load(name)) is not None:
            machine = machine or r["machine"]
            out += [f"**GRPO step throughput, {r['size']} policy** ({r['params']:,} parameters; ours / TRL "
                    f"= {r['ratio']:.2f}×):", "",
                    _md(r["rows"], [("side", "side", ""), ("median_step_s", "median step s", ".2f"),
                                    ("samples_per_s", "samples/s", ".1f"), ("tokens_per_s", "tokens/s", ".0f"),
                                    ("floor_s", "floor s (FLOPs at peak)", ".1f"), ("of_peak", "floor / step", ".0%")]),
                    ""]
            if phases := r["raw"]["ours"].get("phase_s"):
                out += ["Where our step goes (median seconds, rank 0): "
                        + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()) + ".", ""]
    for name in ("pipelined", "pipelined_lr0.0002", "pipelined_1w"):
        if (r := _load(name)) is None:
            continue
        machine = machine or r["machine"]
        workers = r["rows"][0].get("workers", 2)
        lr = f", learning rate {r['learning_rate']:g}" if "learning_rate" in r else ""
        out += [f"**Pipelined vs synchronous rollouts, demo GRPO, {workers} Ray worker(s)** (max_lag {r['max_lag']}, "
                f"{r['chunks']} chunks per batch{lr}; same SFT policy, reward model, prompts and seeds):", "",
                _md(r["rows"], [("mode", "mode", ""), ("seed", "seed", ""), ("fit_s", "training s", ".0f"),
                                ("samples_per_s", "samples/s", ".1f"), ("generate_s", "generate s/step", ".2f"),
                                ("update_s", "update s/step", ".2f"), ("lag_mean", "mean lag", ".2f"),
                                ("accuracy_before", "accuracy before", ".3f"), ("accuracy_after", "after", ".3f"),
                                ("reward_last5", "reward, last 5 steps", ".3f"), ("kl_max", "max KL", ".2f")]), ""]
        if "summary" in r and r["summary"][0]["seeds"] > 1:  # one seed: the table above says it all
            out += [f"Over {r['summary'][0]['seeds']} seeds, mean (sample sd):", "",
                    _md([{**row, "accuracy": f"{row['accuracy_after']:.3f} ({row['accuracy_sd']:.3f})",
                          "verifiable": f"{row['verifiable_last10']:.3f} ({row['verifiable_sd']:.3f})"}
                         for row in r["summary"]],
                        [("mode", "mode", ""), ("samples_per_s", "samples/s", ".1f"),
                         ("accuracy", "held-out accuracy after", ""),
                         ("verifiable", "exact match, last 10 steps' samples", "")]), ""]
    if (r := _load("scaling")) is not None:
        machine = machine or r["machine"]
        out += [f"**Reward-model training, 1 → 2 Ray workers** (global batch {r['global_batch']} pairs):", "",
                _md(r["rows"], [("workers", "workers", ""), ("pairs_per_s", "pairs/s", ".0f"),
                                ("speedup", "speedup", ".2f")]), ""]
    if (r := _load("orchestration_overhead")) is not None:
        machine = machine or r["machine"]
        rows = [{"part": k, "s": v} for k, v in r["compute_s"].items()]
        rows += [{"part": "**model compute**", "s": r["model_compute_s"]}, {"part": "**overhead**", "s": r["overhead_s"]},
                 {"part": "wall", "s": r["wall_s"]}]
        for row in rows:
            row["share"] = row["s"] / r["wall_s"]
        out += [f"**Demo wall time** (overhead {r['overhead_share']:.0%} of {r['wall_s']:.0f} s):", "",
                _md(rows, [("part", "part", ""), ("s", "seconds", ".1f"), ("share", "share", ".1%")]), ""]
        stages = [{"stage": k, "s": v} for k, v in r["stage_wall_s"].items()]
        out += ["**Demo stages, wall time of each stage's MLflow run** (start-up, checkpoints and logging included):",
                "", _md(stages, [("stage", "stage", ""), ("s", "seconds", ".1f")]), ""]
    if machine:
        whens = sorted(json.loads(f.read_text())["machine"]["when"] for f in RESULTS.glob("*.json"))
        out.insert(0, f"Measured on {machine['cpu']}, {machine['cores']} cores, {machine['ram_gib']} GiB (torch "
                      f"{machine['torch']}, vLLM {machine['vllm']}), each table by its script, idle machine, "
                      f"between {whens[0]} and {whens[-1]}.\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
