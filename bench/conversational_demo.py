"""The demo's task as a user would bring it: an SFT model from an earlier run as `model.pretrained`
(`sft.enabled: false`) and the demo pairs in the conversational format, through `rlhf run`.

Each seed runs the pipeline twice from the same pretrained directory: once on the standard
(text) pairs, once on the same pairs as conversations rendered by a chat template. The
template writes the user's turn as it is and ends the assistant's with EOS, so a policy
trained on text sees the same tokens: the held-out gain must be within the seed noise of
the text run, and of the demo's own spread (bench/results/seed_spread.json).

    .venv/bin/python bench/conversational_demo.py --sft-dir runs/demo-<stamp>/models/sft
    .venv/bin/python bench/conversational_demo.py --sft-dir DIR --seeds 0 1 2

Writes bench/results/conversational_demo.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, RESULTS, save, table  # noqa: E402
from rlhf_core.config import load_config  # noqa: E402
from rlhf_core.data.formats import as_conversational  # noqa: E402
from rlhf_core.data.schema import read_table, write_jsonl  # noqa: E402
from rlhf_core.data.synthetic import generate_demo_data  # noqa: E402

# The user's turn as it is, the assistant's ended by EOS; the tokenizer adds the BOS the
# template writes (rlhf_core.chat.render_prompt).
DEMO_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}"
                 "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def write_data(work: Path) -> dict[str, dict[str, str]]:
    """The demo's files in both formats: {variant: {data key: path}}."""
    cfg = load_config(REPO / "configs" / "demo.yaml")
    files = generate_demo_data(cfg.data.demo, work / "demo-data")
    prefs = read_table(files.preferences)[["prompt", "chosen", "rejected"]].to_dict("records")
    evals = read_table(files.eval)[["prompt", "answer"]].to_dict("records")
    # the prompts the demo's policy stage trains on: the SFT corpus's and the pairs', in order
    prompts = list(dict.fromkeys(list(read_table(files.sft)["prompt"]) + [r["prompt"] for r in prefs]))
    standard = {"preferences_path": str(files.preferences), "eval_path": str(files.eval),
                "prompts_path": str(write_jsonl([{"prompt": p} for p in prompts], work / "prompts.jsonl"))}
    conversational = {
        "preferences_path": str(write_jsonl([as_conversational(r) for r in prefs], work / "chat-pairs.jsonl")),
        "eval_path": str(write_jsonl([as_conversational(r) for r in evals], work / "chat-eval.jsonl")),
        "prompts_path": str(write_jsonl([as_conversational({"prompt": p}) for p in prompts], work / "chat-prompts.jsonl")),
    }
    return {"standard": standard, "conversational": conversational}


def run(variant: str, data: dict[str, str], sft_dir: Path, seed: int, work: Path) -> dict:
    raw = {"base": str(REPO / "configs" / "demo.yaml"), "reward": {}, "policy": {},
           "name": f"{variant}-s{seed}", "output_dir": str(work / "runs")}
    raw["data"] = data
    raw["model"] = {"pretrained": str(sft_dir), **({"chat_template": DEMO_TEMPLATE} if variant == "conversational" else {})}
    raw["sft"] = {"enabled": False}
    raw["reward"]["seed"] = seed
    raw["policy"]["seed"] = seed
    raw["serving"] = {"enabled": False}
    raw["tracking"] = {"tracking_uri": f"sqlite:///{work / 'mlflow.db'}", "experiment": "conversational-demo"}
    config = work / f"{variant}-s{seed}.yaml"
    config.write_text(yaml.safe_dump(raw))
    done = subprocess.run([str(Path(sys.executable).parent / "rlhf"), "run", "--config", str(config)], cwd=work,
                          capture_output=True, text=True)
    [summary_path] = sorted((work / "runs").glob(f"{variant}-s{seed}-*/summary.json"))[-1:]
    summary = json.loads(summary_path.read_text())
    policy, reward = summary["stages"].get("policy", {}), summary["stages"].get("reward", {})
    row = {"variant": variant, "seed": seed, "status": summary["status"], "exit": done.returncode,
           "reward_accuracy": reward.get("eval_accuracy"), "accuracy_before": policy.get("accuracy_before"),
           "accuracy_after": policy.get("accuracy_after"), "policy_seconds": policy.get("seconds")}
    if row["accuracy_before"] is not None and row["accuracy_after"] is not None:
        row["gain"] = round(row["accuracy_after"] - row["accuracy_before"], 3)
    if summary["status"] != "completed":
        row["error"] = summary.get("error", "")[:300]
    return row


def spread(rows: list[dict]) -> dict | None:
    gains = [r["gain"] for r in rows if r.get("gain") is not None]
    if not gains:
        return None
    return {"n": len(gains), "mean": round(statistics.mean(gains), 3),
            "sd": round(statistics.stdev(gains), 3) if len(gains) > 1 else None, "min": min(gains), "max": max(gains)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-dir", type=Path, required=True, help="models/sft of an earlier demo run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args()
    sft_dir = args.sft_dir.resolve()
    with tempfile.TemporaryDirectory(prefix="conversational-demo-") as tmp:
        work = Path(tmp)
        data = write_data(work)
        rows = []
        for seed in args.seeds:
            for variant in ("standard", "conversational"):
                rows.append(run(variant, data[variant], sft_dir, seed, work))
                print(table(rows[-1:], list(rows[-1])), flush=True)
    demo = json.loads((RESULTS / "seed_spread.json").read_text()).get("summary", {}) \
        if (RESULTS / "seed_spread.json").is_file() else {}
    result = {"sft_dir": str(sft_dir), "rows": rows,
              "standard": spread([r for r in rows if r["variant"] == "standard"]),
              "conversational": spread([r for r in rows if r["variant"] == "conversational"]),
              "demo_seed_spread": demo}
    print(table(rows, ["variant", "seed", "status", "reward_accuracy", "accuracy_before", "accuracy_after", "gain"]))
    print("gain, standard:", result["standard"], " conversational:", result["conversational"])
    print("written:", save("conversational_demo", result))


if __name__ == "__main__":
    main()
