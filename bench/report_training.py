"""The sections of docs/benchmarks.md about training (`bench/report.py` renders the page):
seed spread, the conversational demo, pretrained models at scale, the policy stage's memory,
logits at the response positions, and DPO/KTO against GRPO."""
from __future__ import annotations

import statistics
from pathlib import Path

from bench.common import mean_sd
from bench.report_format import Columns, load, md_table, measured_on, not_run


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


KERNEL_ROWS: Columns = [
    ("kernel_path", "kernel path", ""), ("aten_capability", "ATen", ""), ("threads", "threads", ""),
    ("seed", "seed", ""), ("base_accuracy", "base accuracy", ".3f"), ("reward_accuracy", "reward-model accuracy", ".3f"),
    ("final_accuracy", "final accuracy", ".3f"), ("gain", "gain", "+.3f"), ("no_carry", "no_carry", ".3f"),
    ("no_carry_looks", "no_carry looks (rows)", ""), ("eval_looks", "eval looks (prompts, open calls)", ""),
    ("verdict", "gates", ""), ("wall_s", "wall s", ".0f"),
    ("met", "met the bars", ""),
]


def seed_spread_kernels(results: Path) -> list[str]:
    if (r := load("seed_spread_kernels", results)) is None:
        return not_run("seed_spread_kernels", "seed_spread.py --seeds 0 1 --threads 2 1 --kernel-paths native avx2 "
                                              "mkl_avx2 --name seed_spread_kernels")
    rows = []
    for row in r["rows"]:
        suite = (row.get("regression") or {}).get("no_carry", {})
        looks = suite.get("looks") or []
        rows.append({**row, "met": "yes" if row["success"] else "**no**", "no_carry": suite.get("accuracy"),
                     "no_carry_looks": " → ".join(str(look[0]) for look in looks) or None,
                     "eval_looks": " → ".join(f"{n}" + (f" ({', '.join(still)})" if still else "")
                                              for n, still, _ in row.get("eval_looks") or []) or None})
    gains = [row["gain"] for row in r["rows"] if row.get("gain") is not None]
    paths = sorted({row["kernel_path"] for row in r["rows"]})
    lines = [measured_on(r, "seed_spread_kernels") + f" CPU flags: {', '.join(r.get('cpu_flags', [])) or 'not recorded'}.",
             "", md_table(rows, KERNEL_ROWS), "",
             f"**{sum(bool(row['success']) for row in r['rows'])} of {len(rows)}** rows over {len(paths)} kernel paths "
             f"({', '.join(paths)}) got through every bar and the gates."]
    if gains:
        lines[-1] += (f" Gain in held-out accuracy {statistics.fmean(gains):+.3f} on average "
                      f"(from {min(gains):+.3f} to {max(gains):+.3f}).")
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


def offline_memory(results: Path) -> list[str]:
    """The DPO (and KTO) stage's worker by phase, every step and a few, beside the preflight's estimate."""
    runs = [(name, r) for name in ("offline_memory_full", "offline_memory", "offline_memory_kto")
            if (r := load(name, results)) is not None]
    if not runs:
        return not_run("offline_memory_full", "offline_memory.py --name offline_memory_full")
    rows = [{"file": f"`{name}.json`", "algorithm": r["algorithm"], "rows": r["settings"]["rows"], "steps": r["steps"],
             **r["rank0_peak_gib_by_phase"], "estimate": r["preflight_policy_stage_gib"],
             "ratio": r["estimate_over_measured"], "minutes": r["stage_seconds"] / 60} for name, r in runs]
    s = runs[0][1]["settings"]
    return [measured_on(runs[0][1], runs[0][0]) + f" Micro-batches of {s['micro_batch_size']} pairs of up to "
            f"{s['max_length']} tokens, {s['batch_size']} pairs a step, LoRA {'on' if s['lora'] else 'off'}; "
            f"{s['held_out_pairs']} held-out pairs and {s['eval_prompts']} questions at the end.", "",
            md_table(rows, [("file", "run", ""), ("algorithm", "method", ""), ("rows", "training pairs", ""),
                            ("steps", "steps", ""), ("loaded", "loaded, GiB", ""), ("trained", "trained, GiB", ""),
                            ("evaluated", "evaluated, GiB", ""), ("estimate", "preflight, GiB", ""),
                            ("ratio", "estimate / peak", ""), ("minutes", "stage, min", ".1f")])]


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
