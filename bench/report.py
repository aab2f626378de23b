"""Write the latest benchmark tables (bench/results/*.json) into docs/benchmarks.md.

The page's prose is its own; each table lives between a pair of marker comments,

    <!-- report:NAME -->
    ...
    <!-- /report:NAME -->

and this script replaces what is between them with NAME's rendering of the result files,
each table with the machine it was measured on. A result file that does not exist yet is
rendered as a line saying how to produce it, so a new benchmark can be documented before its
first run. A marker with no renderer, or a renderer with no marker, is an error: the page and
this script must name the same sections.

    python bench/report.py           # rewrite the tables in docs/benchmarks.md
    python bench/report.py --check   # exit 1 when the page is not what the results say
    python bench/report.py --print   # print the tables, touch nothing
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, RESULTS, mean_sd  # noqa: E402

PAGE = REPO / "docs" / "benchmarks.md"
MARKED = re.compile(r"(<!-- report:(?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- /report:(?P=name) -->)", re.DOTALL)

Columns = list[tuple[str, str, str]]  # (key in the row, column title, format spec; "" = str())


class ReportError(RuntimeError):
    """The page and the renderers disagree on the sections."""


def load(name: str, results: Path = RESULTS) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def md_table(rows: list[dict], columns: Columns) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(key), fmt) for key, _, fmt in columns) + " |" for r in rows]
    return "\n".join(lines)


def _cell(value, fmt: str) -> str:
    if value is None:
        return "–"
    text = format(value, fmt) if fmt else str(value)
    return text.replace("|", "\\|").replace("\n", " ")  # a free-text cell must not break the table


def measured_on(result: dict, name: str) -> str:
    """Where a result file was measured, without its date (the file has it; history is git's)."""
    m = result.get("machine") or {}
    parts = [m.get("cpu", "an unknown CPU")]
    if m.get("cores"):
        parts.append(f"{m['cores']} cores")
    if m.get("ram_gib"):
        parts.append(f"{m['ram_gib']} GiB")
    parts += [f"{label} {m[key]}" for key, label in (("python", "Python"), ("torch", "torch"), ("vllm", "vLLM"))
              if m.get(key)]
    return f"Measured on {', '.join(parts)} (`bench/results/{name}.json`)."


def not_run(name: str, script: str) -> list[str]:
    return [f"No results yet (`bench/results/{name}.json`): run `.venv/bin/python bench/{script}`."]


# -- one renderer per section: the lines between its markers ---------------------------------


def rollout_generation(results: Path) -> list[str]:
    if (r := load("rollout_generation", results)) is None:
        return not_run("rollout_generation", "rollout_generation.py")
    return [measured_on(r, "rollout_generation"), "",
            f"{r['group']} samples per prompt, {r['tokens']} tokens each; tokens/s:", "",
            md_table(r["rows"], [("size", "policy", ""), ("params", "parameters", ","),
                                 ("completions", "completions", ""), ("hf_tokens_per_s", "HF generate", ",.0f"),
                                 ("ours_tokens_per_s", "our engine", ",.0f"), ("speedup", "ours / HF", ".2f")])]


def compute_bound(results: Path) -> list[str]:
    if (r := load("compute_bound", results)) is None:
        return not_run("compute_bound", "compute_bound.py")
    ceiling = r["tokens_per_s_ceiling"]
    return [measured_on(r, "compute_bound"), "",
            md_table(r["rows"], [("tokens", "tokens (rows)", ""), ("k", "in", ""), ("n", "out", ""),
                                 ("gflop_per_s", "fp32 GFLOP/s", ".0f")]), "",
            f"Best: {r['peak_gflop_per_s']:.0f} GFLOP/s, a decode ceiling of {ceiling['25m']:,.0f} tokens/s "
            f"for the 25M policy and {ceiling['demo']:,.0f} for the demo policy."]


def weight_sync(results: Path) -> list[str]:
    if (r := load("weight_sync", results)) is None:
        return not_run("weight_sync", "weight_sync.py")
    out = [measured_on(r, "weight_sync"), "",
           f"Sync against one stand-in step of {r['prompts']} prompts × 8 samples × {r['tokens']} tokens plus a "
           "train pass:", "",
           md_table(r["rows"], [("size", "policy", ""), ("params", "parameters", ","), ("MB", "MB", ".0f"),
                                ("sync_s", "sync s", ".3f"), ("step_s", "step s", ".2f"),
                                ("sync_share", "share", ".1%")])]
    if (real := r.get("real_demo")) is not None:
        out += ["", f"The trainer's own demo GRPO step (`timing/sync` against the step's wall time, median of "
                    f"{real['steps']} steps): sync {real['sync_s'] * 1e3:.0f} ms of {real['step_s']:.2f} s = "
                    f"**{real['sync_share']:.1%}**."]
    return out


def rl_step_vs_trl(results: Path) -> list[str]:
    out: list[str] = []
    for name in ("rl_step_vs_trl_demo", "rl_step_vs_trl_25m"):
        if (r := load(name, results)) is None:
            continue
        out += [f"**{r['size']} policy** ({r['params']:,} parameters; ours / TRL = {r['ratio']:.2f}×). "
                + measured_on(r, name), "",
                md_table(r["rows"], [("side", "side", ""), ("median_step_s", "median step s", ".2f"),
                                     ("samples_per_s", "samples/s", ".1f"), ("tokens_per_s", "tokens/s", ".0f"),
                                     ("floor_s", "floor s (FLOPs at peak)", ".1f"),
                                     ("of_peak", "floor / step", ".0%")]), ""]
        if phases := r["raw"]["ours"].get("phase_s"):
            out += ["Where our step goes (median seconds, rank 0): "
                    + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()) + ".", ""]
    return out[:-1] if out else not_run("rl_step_vs_trl_25m", "rl_step_vs_trl.py --size 25m")


PIPELINED_ROWS: Columns = [
    ("mode", "mode", ""), ("seed", "seed", ""), ("fit_s", "training s", ".0f"),
    ("samples_per_s", "samples/s", ".1f"), ("generate_s", "generate s/step", ".2f"),
    ("update_s", "update s/step", ".2f"), ("lag_mean", "mean lag", ".2f"),
    ("accuracy_before", "accuracy before", ".3f"), ("accuracy_after", "after", ".3f"),
    ("reward_last5", "reward, last 5 steps", ".3f"), ("kl_max", "max KL", ".2f"),
]


def pipelined(results: Path) -> list[str]:
    out: list[str] = []
    for name in ("pipelined", "pipelined_lr0.0002", "pipelined_1w"):
        if (r := load(name, results)) is not None:
            out += _pipelined_run(r, name) + [""]
    return out[:-1] if out else not_run("pipelined", "pipelined.py")


def _pipelined_run(r: dict, name: str) -> list[str]:
    workers = r["rows"][0].get("workers", 2)
    lr = f", learning rate {r['learning_rate']:g}" if "learning_rate" in r else ""
    out = [f"**{workers} Ray worker(s)**, max_lag {r['max_lag']}, {r['chunks']} chunks per batch{lr}. "
           + measured_on(r, name), "", md_table(r["rows"], PIPELINED_ROWS), ""]
    if "summary" in r and r["summary"][0]["seeds"] > 1:  # one seed: the table above says it all
        rows = [{**row, "accuracy": f"{row['accuracy_after']:.3f} ({row['accuracy_sd']:.3f})",
                 "verifiable": f"{row['verifiable_last10']:.3f} ({row['verifiable_sd']:.3f})"}
                for row in r["summary"]]
        out += [f"Over {r['summary'][0]['seeds']} seeds, mean (sample sd):", "",
                md_table(rows, [("mode", "mode", ""), ("samples_per_s", "samples/s", ".1f"),
                                ("accuracy", "held-out accuracy after", ""),
                                ("verifiable", "exact match, last 10 steps' samples", "")]), ""]
    return out[:-1]


def scaling(results: Path) -> list[str]:
    if (r := load("scaling", results)) is None:
        return not_run("scaling", "scaling.py")
    return [measured_on(r, "scaling"), "", f"Global batch {r['global_batch']} pairs:", "",
            md_table(r["rows"], [("workers", "workers", ""), ("pairs_per_s", "pairs/s", ".0f"),
                                 ("speedup", "speedup", ".2f")])]


def orchestration_overhead(results: Path) -> list[str]:
    if (r := load("orchestration_overhead", results)) is None:
        return not_run("orchestration_overhead", "orchestration_overhead.py")
    rows = [{"part": k, "s": v} for k, v in r["compute_s"].items()]
    rows += [{"part": "**model compute**", "s": r["model_compute_s"]}, {"part": "**overhead**", "s": r["overhead_s"]},
             {"part": "wall", "s": r["wall_s"]}]
    for row in rows:
        row["share"] = row["s"] / r["wall_s"]
    stages = [{"stage": k, "s": v} for k, v in r["stage_wall_s"].items()]
    return [measured_on(r, "orchestration_overhead"), "",
            f"Overhead {r['overhead_share']:.0%} of {r['wall_s']:.0f} s:", "",
            md_table(rows, [("part", "part", ""), ("s", "seconds", ".1f"), ("share", "share", ".1%")]), "",
            "Wall time of each stage's MLflow run (start-up, checkpoints and logging included):", "",
            md_table(stages, [("stage", "stage", ""), ("s", "seconds", ".1f")])]


SEED_SPREAD_ROWS: Columns = [
    ("seed", "seed", ""), ("threads", "threads", ""), ("stages", "stages", ""), ("sft_steps", "SFT steps", ""),
    ("sft_plateau_step", "plateau step", ""), ("sft_plateau_share", "plateau share", ".0%"),
    ("base_accuracy", "base accuracy", ".3f"), ("reward_accuracy", "reward-model accuracy", ".3f"),
    ("final_accuracy", "final accuracy", ".3f"),
    ("gain", "gain", "+.3f"), ("sft_s", "SFT s", ".0f"), ("reward_s", "reward s", ".0f"),
    ("policy_s", "policy s", ".0f"), ("wall_s", "wall s", ".0f"), ("met", "met the bars", ""),
    ("failure", "failure", ""),
]


def seed_spread(results: Path) -> list[str]:
    if (r := load("seed_spread", results)) is None:
        return not_run("seed_spread", "seed_spread.py")
    rows = [{**row, "met": "yes" if row["success"] else "**no**"} for row in r["rows"]]
    succeeded = sum(bool(row["success"]) for row in r["rows"])
    full = [row for row in r["rows"] if row.get("stages", "all") == "all"]
    gains = [row["gain"] for row in full]
    plateau = [row["sft_plateau_share"] for row in r["rows"] if row["sft_plateau_share"] is not None]
    lines = [measured_on(r, "seed_spread") + f" Config `{r.get('config', 'configs/demo.yaml')}`; stages `all` ran "
             "SFT, reward model, policy and gates, `sft` SFT alone.", "",
             md_table(rows, SEED_SPREAD_ROWS), "",
             f"**{succeeded} of {len(rows)}** runs met the demo's bars."]
    if gains:
        lines[-1] += (f" Over the {len(full)} runs of every stage, the gain in held-out accuracy was "
                      f"{statistics.fmean(gains):+.3f} on average (from {min(gains):+.3f} to {max(gains):+.3f}).")
    if plateau:
        lines[-1] += f" The latest plateau came at {max(plateau):.0%} of the SFT budget."
    return lines


def conversational_demo(results: Path) -> list[str]:
    if (r := load("conversational_demo", results)) is None:
        return not_run("conversational_demo", "conversational_demo.py --sft-dir runs/demo-<stamp>/models/sft")
    columns = [("variant", "data", ""), ("seed", "seed", ""), ("status", "status", ""),
               ("reward_accuracy", "reward-model accuracy", ".3f"), ("accuracy_before", "base accuracy", ".3f"),
               ("accuracy_after", "final accuracy", ".3f"), ("gain", "gain", "+.3f")]
    lines = [measured_on(r, "conversational_demo"), "", md_table(r["rows"], columns), ""]
    for variant in ("standard", "conversational"):
        if (g := r.get(variant)) is not None:
            lines.append(f"- {variant}: gain {g['mean']:+.3f} over {g['n']} seed(s) "
                         f"(from {g['min']:+.3f} to {g['max']:+.3f}).")
    if (demo := r.get("demo_seed_spread", {}).get("gain")) is not None:
        lines.append(f"- the demo itself (`seed_spread`): gain {demo['mean']:+.3f} "
                     f"(from {demo['min']:+.3f} to {demo['max']:+.3f}).")
    return lines


def pretrained_scale(results: Path) -> list[str]:
    if (r := load("pretrained_scale", results)) is None:
        return not_run("pretrained_scale", "pretrained_scale.py")
    model = (f"{r['parameters_m']:.0f}M parameters ({r['layers']} layers, width {r['hidden']}, vocabulary "
             f"{r['vocab']:,}, {r['kv_heads']} key/value heads, tied embeddings: {r['tied_embeddings']})")
    rows = [{"figure": k, "value": v} for k, v in (
        ("workers", r["workers"]), ("rollouts per step x tokens", f"{r['rollouts_per_step']} x {r['max_new_tokens']}"),
        ("seconds per RL step (median after the first)", r["seconds_per_step"]),
        ("first step, s", r["first_step_s"]), ("weight sync, s", r["weight_sync_s"]),
        ("policy stage wall time, s", r["stage_wall_s"]),
        ("memory estimate of the preflight, GiB", r["estimated_gib"]))]
    rows += [{"figure": f"phase {k.removeprefix('timing/')}, s", "value": v} for k, v in r["phases_s"].items() if v]
    return [measured_on(r, "pretrained_scale") + f" Model: {model}.", "",
            md_table(rows, [("figure", "figure", ""), ("value", "value", "")]), "",
            md_table(r["peak_rss"], [("process", "process", ""), ("peak_rss_gib", "peak resident memory, GiB", "")])]


def targets(results: Path) -> list[str]:
    rows = [row for make in (_rollout_target, _sync_target, _trl_target, _demo_targets) for row in make(results)]
    if not rows:
        return ["No results yet: run the benchmarks below."]
    return ["From the result files below, each with the machine it was measured on.", "",
            md_table(rows, [("target", "target", ""), ("measured", "measured", ""), ("met", "met", "")])]


def _rollout_target(results: Path) -> list[dict]:
    if (r := load("rollout_generation", results)) is None:
        return []
    big = [row for row in r["rows"] if row["size"] == "25m"]
    met = [str(row["completions"]) for row in big if row["speedup"] >= 1.5]
    return [{"target": "rollouts ≥ 1.5× HF `generate` (25M policy)",
             "measured": ", ".join(f"{row['speedup']:.2f}× at {row['completions']}" for row in big),
             "met": f"at {', '.join(met)} completions" if met else "no"}]


def _sync_target(results: Path) -> list[dict]:
    if (r := load("weight_sync", results)) is None:
        return []
    shares = [(row["size"], row["sync_share"]) for row in r["rows"]]
    if (real := r.get("real_demo")) is not None:
        shares.append(("the trainer's demo step", real["sync_share"]))
    return [{"target": "weight sync < 5% of an RL step", "measured": ", ".join(f"{s:.1%} ({n})" for n, s in shares),
             "met": ", ".join(n for n, s in shares if s < 0.05) or "no"}]


def _trl_target(results: Path) -> list[dict]:
    if (r := load("rl_step_vs_trl_25m", results)) is None:
        return []
    return [{"target": "GRPO step ≥ 1.5× TRL's (25M policy)", "measured": f"{r['ratio']:.2f}×",
             "met": "yes" if r["ratio"] >= 1.5 else "no"}]


def _demo_targets(results: Path) -> list[dict]:
    if (r := load("orchestration_overhead", results)) is None:
        return []
    return [{"target": "demo < 10 minutes after set-up", "measured": f"{r['wall_s']:.0f} s",
             "met": "yes" if r["wall_s"] < 600 else "no"},
            {"target": "orchestration overhead < 15% of the demo", "measured": f"{r['overhead_share']:.0%}",
             "met": "yes" if r["overhead_share"] < 0.15 else "no"}]


def gateway(results: Path) -> list[str]:
    if (r := load("gateway", results)) is None:
        return not_run("gateway", "gateway.py")
    rows = [{"concurrency": c, "direct_p50": lat["direct"]["p50_ms"], "gateway_p50": lat["gateway"]["p50_ms"],
             "added_p50": lat["added"]["p50_ms"], "direct_p99": lat["direct"]["p99_ms"],
             "gateway_p99": lat["gateway"]["p99_ms"], "added_p99": lat["added"]["p99_ms"]}
            for c, lat in r["latency"].items()]
    inside, rated = r["added_inside_gateway"], r["ratings"]
    return [measured_on(r, "gateway"), "",
            md_table(rows, [("concurrency", "concurrent requests", ""), ("direct_p50", "vLLM p50 ms", ".1f"),
                            ("gateway_p50", "gateway p50 ms", ".1f"), ("added_p50", "added p50 ms", "+.1f"),
                            ("direct_p99", "vLLM p99 ms", ".1f"), ("gateway_p99", "gateway p99 ms", ".1f"),
                            ("added_p99", "added p99 ms", "+.1f")]), "",
            f"The gateway's own account (its total minus the upstream's, all requests): mean "
            f"{inside['mean_ms']:.1f} ms. Ratings: {rated['per_second']:.0f}/s at {rated['concurrency']} concurrent "
            "clients, each acknowledged after its transaction committed (SQLite, WAL, synchronous=FULL)."]


def resume(results: Path) -> list[str]:
    if (r := load("resume", results)) is None:
        return not_run("resume", "resume.py")
    rows = [{**row, "steps": ", ".join(f"{s} {v}" for s, v in (row.get("resumed_from_step") or {}).items() if v)}
            for row in r["rows"] if row.get("saved_s") is not None]
    return [measured_on(r, "resume"), "",
            f"Starting over (the same config, uninterrupted, in a fresh store): {r['scratch_s']:.1f} s.", "",
            md_table(rows, [("stage", "killed in", ""), ("killed_after_s", "killed after s", ".1f"),
                            ("seconds", "resume to the end s", ".1f"), ("saved_s", "saved s", "+.1f"),
                            ("saved_share", "saved share", ".0%"), ("steps", "resumed from step", "")])]


def policy_memory(results: Path) -> list[str]:
    if (r := load("policy_memory", results)) is None:
        return not_run("policy_memory", "pretrained_scale.py --variants full full+gc lora lora+gc --name policy_memory")
    m = r["model"]
    model = (f"{m['parameters_m']:.0f}M parameters ({m['layers']} layers, width {m['hidden']}, vocabulary "
             f"{m['vocab']:,})")
    first = r["variants"][0]
    variants, notes = list(r["variants"]), []
    if (bf16 := load("policy_memory_bf16", results)) is not None and bf16["model"] == m:
        variants += [v | {"variant": v["variant"] + "*"} for v in bf16["variants"]]
        notes = ["", "* `bench/results/policy_memory_bf16.json`, `--variants full+bf16 lora+gc+bf16`: the same model "
                 f"and settings in bf16 mixed precision (`policy.precision: bf16`), measured on {bf16['machine']['cpu']}."]
    rows = [{**v, "update_s": v["phases_s"].get("timing/update")} for v in variants]
    return [measured_on(r, "policy_memory") + f" Model: {model}; {first['workers']} workers, micro-batch {r['micro_batch']}, "
            f"{first['rollouts_per_step']} rollouts of {first['max_new_tokens']} tokens per step.", "",
            md_table(rows, [("variant", "actor trains", ""), ("trainer_peak_gib", "peak per trainer worker, GiB", ""),
                            ("engine_peak_gib", "peak vLLM process, GiB", ""),
                            ("seconds_per_step", "s per RL step", ""), ("update_s", "update phase, s", ""),
                            ("weight_sync_s", "weight sync, s", "")]), *notes]


def response_logits(results: Path) -> list[str]:
    if (r := load("response_logits", results)) is None:
        return not_run("response_logits", "response_logits.py")
    run = load("policy_logits_after", results), load("policy_logits_before", results)
    notes = []
    if all(run):
        after, before = (x.get("variants", [x])[0] for x in run)  # one variant: the row itself
        notes = ["", f"The whole GRPO stage at this size (`pretrained_scale.py --variants full --micro-batch 16`, "
                 f"prompts of about 20 tokens): peak per trainer worker {before['trainer_peak_gib']} GiB before, "
                 f"{after['trainer_peak_gib']} GiB after; update phase {before['phases_s']['timing/update']} s before, "
                 f"{after['phases_s']['timing/update']} s after (`bench/results/policy_logits_{{before,after}}.json`)."]
    return [measured_on(r, "response_logits") + f" Model: {r['model']}.", "",
            md_table(r["rows"], [("prompt_tokens", "prompt tokens", ""), ("response_tokens", "response tokens", ""),
                                 ("every_column_gib", "head over every column, GiB", ""),
                                 ("response_columns_gib", "head over the response columns, GiB", ""),
                                 ("memory_ratio", "ratio", ""), ("every_column_s", "s before", ""),
                                 ("response_columns_s", "s after", ""),
                                 ("max_abs_logprob_diff", "largest log-prob difference", "")]), *notes]


def dpo_vs_grpo(results: Path) -> list[str]:
    if (r := load("dpo_vs_grpo", results)) is None:
        return not_run("dpo_vs_grpo", "dpo_vs_grpo.py")
    kto, lora = load("kto_on_demo", results), load("grpo_lora_on_demo", results)
    rows, notes = method_rows(r["rows"]), []
    if kto is not None:  # a separate invocation from the same SFT policy
        rows += method_rows(kto["rows"], mark="*" if kto.get("note") else "")
        notes = ["KTO: `bench/results/kto_on_demo.json`, `bench/dpo_vs_grpo.py --methods kto`"
                 + (f"; * {kto['note']}." if kto.get("note") else ".")]
    if lora is not None:  # its own invocation, GRPO beside it again: compare those two rows
        adapters = lora["lora"]
        rate = "the policy's" if adapters["learning_rate"] is None else f"{adapters['learning_rate']:g}"
        rows += method_rows(lora["rows"], mark="†")
        notes += ["† `bench/results/grpo_lora_on_demo.json`, `bench/dpo_vs_grpo.py --methods grpo-lora grpo`: "
                  f"GRPO with LoRA adapters (rank {adapters['rank']}, alpha {adapters['alpha']:g}, "
                  f"{adapters['target_modules']}, learning rate {rate}) and GRPO again, in one invocation on "
                  f"{lora['machine']['cpu']}."]
    d = r["dpo"]
    return [measured_on(r, "dpo_vs_grpo") + f" Seeds {sorted({row['seed'] for row in r['rows']})}; "
            f"DPO/IPO beta {d['beta']}, learning rate {d['learning_rate']:g}, {d['epochs']} epochs of batch "
            f"{d['batch_size']}.", "",
            md_table(rows, [("method", "method", ""), ("runs", "runs", ""), ("acc_before", "accuracy before", ""),
                            ("acc_after", "accuracy after", ""), ("gain", "gain", ""), ("kl", "KL to SFT", ""),
                            ("reward_s", "reward model s", ""), ("policy_s", "policy stage s", ""),
                            ("total_s", "total s", "")]), *([""] + notes if notes else [])]


def method_rows(runs: list[dict], mark: str = "") -> list[dict]:
    """One row per method of `bench/dpo_vs_grpo.py`'s runs: each figure as mean ± sd over its seeds."""
    rows = []
    for method in dict.fromkeys(row["method"] for row in runs):
        mine = [row for row in runs if row["method"] == method]
        entry = {"method": method + mark, "runs": len(mine)}
        for key in ("acc_before", "acc_after", "gain", "kl", "reward_s", "policy_s", "total_s"):
            entry[key] = mean_sd([row[key] for row in mine], 0 if key.endswith("_s") else 3, sign=key == "gain")
        rows.append(entry)
    return rows


SECTIONS: dict[str, Callable[[Path], list[str]]] = {
    "targets": targets, "rollout_generation": rollout_generation, "compute_bound": compute_bound,
    "weight_sync": weight_sync, "rl_step_vs_trl": rl_step_vs_trl, "pipelined": pipelined,
    "scaling": scaling, "orchestration_overhead": orchestration_overhead, "seed_spread": seed_spread,
    "conversational_demo": conversational_demo, "pretrained_scale": pretrained_scale, "gateway": gateway,
    "resume": resume, "dpo_vs_grpo": dpo_vs_grpo, "policy_memory": policy_memory,
    "response_logits": response_logits,
}


def render(results: Path = RESULTS) -> dict[str, str]:
    return {name: "\n".join(make(results)) + "\n" for name, make in SECTIONS.items()}


def fill(page: str, blocks: dict[str, str], where: str = "docs/benchmarks.md") -> str:
    """`page` with the text between each pair of markers replaced by its block."""
    found = [m["name"] for m in MARKED.finditer(page)]
    if unknown := sorted(set(found) - set(blocks)):
        raise ReportError(f"{where}: no renderer in bench/report.py for the marker(s) {', '.join(unknown)}")
    if missing := sorted(set(blocks) - set(found)):
        raise ReportError(f"{where}: no `<!-- report:NAME -->` … `<!-- /report:NAME -->` markers for "
                          f"{', '.join(missing)}")
    return MARKED.sub(lambda m: m[1] + "\n" + blocks[m["name"]] + "\n" + m[4], page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when docs/benchmarks.md is out of date")
    mode.add_argument("--print", dest="print_only", action="store_true", help="print the tables, write nothing")
    args = parser.parse_args(argv)
    blocks = render()
    if args.print_only:
        print("\n".join(f"<!-- {name} -->\n{text}" for name, text in blocks.items()))
        return 0
    page = PAGE.read_text()
    try:
        updated = fill(page, blocks)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if updated != page:
            print("docs/benchmarks.md is not what bench/results/ says: run `python bench/report.py`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(updated)
    print(f"wrote {len(blocks)} sections into {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
