"""A real pretrained chat model on its learned reward alone: SmolLM2-135M-Instruct on the chat task
(configs/chat.yaml, rlhf_core/data/chat_task.py), over seeds, GRPO and DPO on the same pairs.

Each seed generates its own data and runs `rlhf run` as `make demo-chat` does (serving off):
the policy trains on the reward model alone and the task's answer key only measures. Per run
it records held-out gold accuracy before -> after (the policy stage's, judged by
`last_number_match`), the gates' verdict with their accuracy and regression figures, each
stage's seconds, the peak resident memory of every process of the run by role, and the
preflight's estimate of the policy and reward stages beside them.

    .venv/bin/python bench/chat_gain.py                       # seeds 0 1 2, grpo and dpo
    .venv/bin/python bench/chat_gain.py --seeds 0 --algorithms grpo

Needs the converted model (`make chat-model`). Writes bench/results/chat_gain.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, RESULTS, PeakMemory, save, table  # noqa: E402
from rlhf_core.data.chat_task import generate_chat_task  # noqa: E402

MODEL = Path("~/.cache/rlhf/models/smollm2-135m-instruct").expanduser()
GAIN_BAR = {"mean": 0.15, "each": 0.10}  # the targets: +15 points on average, +10 on every seed


def estimates(config: Path) -> dict[str, float]:
    """The preflight's estimates (GiB) of the policy and reward stages for this config."""
    from rlhf_core.config import load_config  # noqa: PLC0415
    from rlhf_core.models.pretrained import inspect_pretrained, stage_estimates  # noqa: PLC0415

    cfg = load_config(config)
    found = stage_estimates(inspect_pretrained(cfg.model.pretrained), cfg)
    return {f"{stage}_stage_gib": round(need / 2**30, 2) for stage, need in found.items()}


def run(seed: int, algorithm: str, work: Path, model: Path) -> dict:
    data = generate_chat_task(work / f"data-s{seed}", seed=seed)
    raw = yaml.safe_load((REPO / "configs" / "chat.yaml").read_text())
    name = f"chat-{algorithm}-s{seed}"
    raw.update(name=name, output_dir=str(work / "runs"))
    raw["model"] = {"pretrained": str(model)}
    raw["data"].update(preferences_path=str(data.preferences), prompts_path=str(data.prompts), eval_path=str(data.eval))
    raw["reward"]["seed"] = seed
    raw["policy"].update(seed=seed, algorithm=algorithm)
    for suite in raw.get("gates", {}).get("regression_suites", []):  # the run's cwd is the scratch directory
        suite["path"] = str(REPO / suite["path"])
    raw["serving"] = {"enabled": False}
    # a store of its own: with one store the seed run first is the next one's champion, and the
    # gates then compare two trained policies (seed 2 was undecided against seed 1's that way)
    raw["tracking"] = {**raw.get("tracking", {}), "tracking_uri": f"sqlite:///{work / f'mlflow-{name}.db'}",
                       "experiment": "chat-gain"}
    config = work / f"{name}.yaml"
    config.write_text(yaml.safe_dump(raw))
    start = time.perf_counter()
    with PeakMemory(every=1.0, driver="rlhf run") as memory:
        done = subprocess.run([str(Path(sys.executable).parent / "rlhf"), "run", "--config", str(config)], cwd=work,
                              capture_output=True, text=True)
    wall = time.perf_counter() - start
    found = sorted((work / "runs").glob(f"{name}-*/summary.json"))
    if not found:
        return {"seed": seed, "algorithm": algorithm, "status": "no summary", "exit": done.returncode,
                "error": (done.stdout + done.stderr)[-600:]}
    summary = json.loads(found[-1].read_text())
    stages = summary["stages"]
    policy, reward, gates = stages.get("policy", {}), stages.get("reward", {}), stages.get("evaluate", {})
    row = {"seed": seed, "algorithm": algorithm, "status": summary["status"], "exit": done.returncode,
           # which configs/chat.yaml and which code ran: rows of earlier sweeps are kept beside this one's
           "chat_yaml_sha256": hashlib.sha256((REPO / "configs" / "chat.yaml").read_bytes()).hexdigest()[:12],
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                    text=True).stdout.strip(),
           "reward_accuracy": reward.get("eval_accuracy"),
           "accuracy_before": policy.get("accuracy_before"), "accuracy_after": policy.get("accuracy_after"),
           "gates": gates.get("status"), "gate_accuracy": gates.get("accuracy"),
           "gate_reference_accuracy": gates.get("reference_accuracy"),
           "win_rate_vs_reference": gates.get("win_rate_vs_reference"), "kl_to_reference": gates.get("kl_to_reference"),
           "regression": gates.get("regression"), "wall_s": round(wall, 1),
           "stage_seconds": {k: v.get("seconds") for k, v in stages.items() if isinstance(v, dict) and "seconds" in v},
           "peak_rss": memory.by_role(), "preflight": estimates(config)}
    if row["accuracy_before"] is not None and row["accuracy_after"] is not None:
        row["gain"] = round(row["accuracy_after"] - row["accuracy_before"], 3)
    if summary["status"] != "completed":
        row["error"] = str(summary.get("error", ""))[:400]
    return row


def verdict(rows: list[dict], algorithm: str) -> dict | None:
    gains = [r["gain"] for r in rows if r["algorithm"] == algorithm and r.get("gain") is not None]
    if not gains:
        return None
    return {"n": len(gains), "mean": round(statistics.mean(gains), 3), "min": min(gains), "max": max(gains),
            "sd": round(statistics.stdev(gains), 3) if len(gains) > 1 else None,
            "meets_bar": statistics.mean(gains) >= GAIN_BAR["mean"] and min(gains) >= GAIN_BAR["each"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--algorithms", nargs="+", default=["grpo", "dpo"], choices=["grpo", "dpo", "ppo", "kto"])
    parser.add_argument("--model", type=Path, default=MODEL, help="the converted SmolLM2 directory (make chat-model)")
    parser.add_argument("--work", type=Path, help="keep the runs here (default: a scratch directory, removed)")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"{args.model} holds no converted model: run `make chat-model`")
    rows = []
    with tempfile.TemporaryDirectory(prefix="chat-gain-") as tmp:
        work = args.work.resolve() if args.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:
            for algorithm in args.algorithms:
                rows.append(run(seed, algorithm, work, args.model.resolve()))
                print(json.dumps(rows[-1]), flush=True)
                result = write(args.model, rows)  # after each run: a long sweep cut short keeps what it measured
    print(table(result["rows"], ["seed", "algorithm", "status", "reward_accuracy", "accuracy_before", "accuracy_after",
                                 "gain", "gates", "wall_s"]))
    print("gain by algorithm:", result["summary"])
    print("written:", RESULTS / "chat_gain.json")


def write(model: Path, rows: list[dict]) -> dict:
    """bench/results/chat_gain.json with these rows, and the earlier file's rows of other (seed,
    algorithm) pairs kept: seeds can be run one sweep at a time (each takes over half an hour)."""
    path = RESULTS / "chat_gain.json"
    earlier = json.loads(path.read_text())["rows"] if path.is_file() else []
    ran = {(r["seed"], r["algorithm"]) for r in rows}
    merged = sorted([r for r in earlier if (r["seed"], r["algorithm"]) not in ran] + rows,
                    key=lambda r: (r["algorithm"], r["seed"]))
    result = {"model": str(model), "bar": GAIN_BAR, "rows": merged,
              "summary": {a: verdict(merged, a) for a in sorted({r["algorithm"] for r in merged})}}
    save("chat_gain", result)
    return result

if __name__ == "__main__":
    main()
