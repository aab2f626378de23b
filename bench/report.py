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
import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, RESULTS  # noqa: E402
from bench.report_format import Columns, load, md_table, measured_on, not_run  # noqa: E402
from bench.report_training import (  # noqa: E402
    conversational_demo, dpo_vs_grpo, offline_memory, policy_memory, pretrained_scale, response_logits, seed_spread,
    seed_spread_kernels,
)

PAGE = REPO / "docs" / "benchmarks.md"
MARKED = re.compile(r"(<!-- report:(?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- /report:(?P=name) -->)", re.DOTALL)

class ReportError(RuntimeError):
    """The page and the renderers disagree on the sections."""


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


def sync_check_cost(results: Path) -> list[str]:
    if (r := load("sync_check_cost", results)) is None:
        return not_run("sync_check_cost", "sync_check_cost.py")
    out = [measured_on(r, "sync_check_cost"), "",
           "One check (the engine's and the fp32 trainer's scoring of the probe rows) against the sync and a "
           "step's floor (generation + one train pass + the sync):", "",
           md_table(r["rows"], [("model", "policy", ""), ("params", "parameters", ","), ("step_shape", "step", ""),
                                ("probe_tokens", "probe tokens", ""), ("check_s", "check s", ".3f"),
                                ("trainer_bf16_s", "trainer bf16 s", ".3f"), ("sync_s", "sync s", ".3f"),
                                ("step_s", "step s", ".2f"), ("check_vs_sync", "check / sync", ".2f"),
                                ("check_share", "check / step", ".1%")])]
    if (real := r.get("real_demo")) is not None:
        out += ["", f"The trainer's own demo GRPO steps (`rollout/verify_s` against the step's wall time, median of "
                    f"{real['steps']} steps): check {real['verify_s'] * 1e3:.0f} ms, sync {real['sync_s'] * 1e3:.0f} ms, "
                    f"step {real['step_s']:.2f} s: **{real['verify_share']:.1%}** of the step; the largest gap "
                    f"measured {real['verify_gap_max']:.2g}."]
    peaks = ", ".join(f"{p['process']} {p['peak_rss_gib']} GiB" for p in r.get("peak_rss", []))
    return out + (["", f"Peak resident memory: {peaks}."] if peaks else [])


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


def gpu_check(results: Path) -> list[str]:
    if (r := load("gpu_check", results)) is None:
        return not_run("gpu_check", "gpu_check.py` on a machine with a CUDA device: `make gpu-check")
    runs = [(name, run) for name, run in (("plain torch", r["grpo"]), ("DeepSpeed", r.get("grpo_deepspeed"))) if run]
    rows = [{"trainer": name, "step": s["step"], **s["seconds"], "tokens_per_s": s["generated_tokens_per_s"],
             "peak": max(s["peak_gpu_memory_gib"].values()), "in_use": max(s["gpu_memory_in_use_gib"].values()),
             "logprob_diff": s["metrics"]["logprob_diff"]} for name, run in runs for s in run["steps"]]
    shape, batch = r["model"], r["batch"]
    estimates = [f"- {name}: {run['memory']['preflight_estimate_gib']['total']:.2f} GiB, "
                 f"{run['memory']['preflight_estimate_gib']['total'] / run['memory']['gpu_memory_in_use_gib']:.2f} "
                 f"of the {run['memory']['gpu_memory_in_use_gib']:.2f} GiB in use" for name, run in runs]
    parts = runs[0][1]["memory"]["preflight_estimate_gib"]
    return [measured_on(r, "gpu_check"), "",
            f"Device tests: {r['tests']['summary']}. GRPO on a random-weight Llama of {shape['shape']} "
            f"({shape['parameters'] / 1e6:.0f}M parameters), {batch['prompts']} prompts x {batch['group']} answers "
            f"of up to {batch['new_tokens']} tokens:", "",
            md_table(rows, [("trainer", "trainer", ""), ("step", "step", ""), ("generate", "generate s", ".2f"),
                            ("logprobs", "logprobs s", ".2f"), ("update", "update s", ".2f"),
                            ("total", "step s", ".2f"), ("tokens_per_s", "generated tokens/s", ",.0f"),
                            ("peak", "peak allocated GiB", ".2f"), ("in_use", "device in use GiB", ".2f"),
                            ("logprob_diff", "logprob diff", ".1e")]), "",
            "The preflight's arithmetic for the same step (`gpu_policy_bytes`: "
            + ", ".join(f"{k} {v:.2f}" for k, v in parts.items() if k != "total") + " GiB) against each run:",
            *estimates]


def gate_answers(results: Path) -> list[str]:
    if (r := load("gate_answers", results)) is None:
        return not_run("gate_answers", "gate_answers.py")
    rows = [{"policy": name, "answers": kind.replace("_", " "), **row} for name, by in r["policies"].items()
            for kind, row in by.items()]
    g = r["gates"]
    return [measured_on(r, "gate_answers"), "",
            f"The first look's {r['asked']} prompts ({r['eval_prompts']} of them eval prompts, the rest the "
            "regression suites'):", "",
            md_table(rows, [("policy", "policy", ""), ("answers", "answered by", ""), ("seconds", "seconds", ".1f"),
                            ("accuracy", "eval accuracy", ".3f"), ("differ_from_hf", "differ from HF", "")]), "",
            f"The gate stage's comparison (`evaluate_on`) with the run's config: {g['seconds']:.1f} s, "
            f"{g['status']} on {g['num_prompts']} prompts (the run itself: {g['recorded_status']}); peak RSS "
            f"{r['peak_rss_gib']:.2f} GiB."]


SECTIONS: dict[str, Callable[[Path], list[str]]] = {
    "targets": targets, "rollout_generation": rollout_generation, "compute_bound": compute_bound,
    "weight_sync": weight_sync, "sync_check_cost": sync_check_cost, "rl_step_vs_trl": rl_step_vs_trl, "pipelined": pipelined,
    "scaling": scaling, "orchestration_overhead": orchestration_overhead, "seed_spread": seed_spread,
    "seed_spread_kernels": seed_spread_kernels,
    "conversational_demo": conversational_demo, "pretrained_scale": pretrained_scale, "gateway": gateway,
    "resume": resume, "dpo_vs_grpo": dpo_vs_grpo, "policy_memory": policy_memory,
    "response_logits": response_logits, "gpu_check": gpu_check, "offline_memory": offline_memory,
    "gate_answers": gate_answers,
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
