"""Scaling the reward-model stage from 1 to 2 Ray Train workers (DeepSpeed ZeRO-2 each), on
the demo's preference pairs and base policy shape, in one run.

Throughput is pairs per second over optimizer steps after the first 5 (warm-up), from the
per-step metrics; the global batch is the same in both runs (micro-batch x workers x
accumulation), so both see the same data per step. On a 2-core machine, 2 workers can at
best double throughput if each has a core to itself; the ratio says what is left.

    .venv/bin/python bench/scaling.py
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import save, table  # noqa: E402
from bench.rollout_generation import demo_tokenizer  # noqa: E402
from rlhf_core.config import DemoDataConfig, ModelConfig, RewardConfig  # noqa: E402
from rlhf_core.data.pairs import split_by_prompt  # noqa: E402
from rlhf_core.data.schema import read_table  # noqa: E402
from rlhf_core.data.synthetic import generate_demo_data  # noqa: E402
from rlhf_core.models.llama import build_policy, save_pretrained_atomic  # noqa: E402
from rlhf_core.testing.sinks import JsonlSink  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    from rlhf_core.distributed.reward_trainer import train_reward_model  # noqa: PLC0415
    from rlhf_core.training.stage_types import StageSite  # noqa: PLC0415

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        files = generate_demo_data(DemoDataConfig(n_sft=10, n_eval=10), tmp / "data")
        pairs = read_table(files.preferences)[["prompt", "chosen", "rejected"]].to_dict("records")
        train, held_out = split_by_prompt(pairs, 0.1, 0)
        tok = demo_tokenizer()
        base = save_pretrained_atomic(build_policy(ModelConfig(), tok, seed=0), tok, tmp / "base")
        for workers in args.workers:
            cfg = RewardConfig(num_workers=workers, micro_batch_size=args.global_batch // workers, epochs=args.epochs,
                               checkpoint_every=10_000, min_eval_accuracy=0.0)
            sink = JsonlSink(tmp / f"metrics-{workers}.jsonl")
            result = train_reward_model(train, held_out, base, cfg,
                                        StageSite(tmp / f"rm{workers}", tmp / "ray", f"scaling-{workers}", sink))
            steps = [json.loads(line) for line in Path(sink.path).read_text().splitlines()][5:]
            pairs_per_s = sum(s["reward/pairs_per_s"] for s in steps) / len(steps)
            rows.append({"workers": workers, "steps": result.steps, "pairs_per_s": pairs_per_s,
                         "fit_s": result.run.seconds, "eval_accuracy": result.eval_accuracy})
            print(table(rows[-1:], list(rows[-1])), flush=True)
    base_rate = rows[0]["pairs_per_s"]
    for row in rows:
        row["speedup"] = row["pairs_per_s"] / base_rate
    print(f"\nReward-model training, global batch {args.global_batch} pairs, steady-state throughput:")
    print(table(rows, ["workers", "steps", "pairs_per_s", "speedup", "fit_s"]))
    print(f"\nwritten {save('scaling', {'global_batch': args.global_batch, 'rows': rows})}")


if __name__ == "__main__":
    main()
