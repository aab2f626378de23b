"""DPO (and IPO) against GRPO on the demo: held-out accuracy gained over the SFT policy, and
what it costs in wall time.

One invocation trains the demo's SFT policy once (or takes `--sft-dir`), then for each seed:

    grpo   GRPO on the task's verifiable reward plus 0.25 x the reward model's score, the
           over-optimisation defences off (`bench.common.defences_off`); it needs the reward
           model first: its training time is counted
    grpo-lora  the same with LoRA adapters (the config's policy.lora settings, enabled) at
           --lora-learning-rate: the rollout engine follows the merged weights
    dpo    policy.algorithm dpo with the config's policy.dpo settings, on the pairs the reward
           model trains on; no reward model, no rollouts
    ipo    the same with loss_type ipo
    kto    policy.algorithm kto with the config's policy.kto settings: each pair unpaired into
           one labelled answer (its chosen or its rejected one), as thumbs up or down would give

Per row: held-out exact-match accuracy before and after (greedy, 200 eval prompts), the gain,
the KL to the SFT policy, and the seconds of the reward stage (GRPO only) and of the policy
stage. The seeds change the policy stage's seed (data order, sampling); the SFT policy and
the reward model are shared, so the spread is the policy stage's own.

    .venv/bin/python bench/dpo_vs_grpo.py                              # grpo, dpo, ipo x 4 seeds
    .venv/bin/python bench/dpo_vs_grpo.py --methods kto --name kto_on_demo
    .venv/bin/python bench/dpo_vs_grpo.py --methods grpo grpo-lora --name grpo_lora_on_demo
    .venv/bin/python bench/dpo_vs_grpo.py --methods dpo --seeds 0 --set learning_rate=1e-4
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, RESULTS, defences_off, machine, save, table  # noqa: E402
from bench.report import method_rows  # noqa: E402
from bench.reward_hacking import sft_policy  # noqa: E402
from rlhf_core.config import PipelineConfig, PolicyConfig, load_config  # noqa: E402
from rlhf_core.data.pairs import split_by_prompt  # noqa: E402
from rlhf_core.data.schema import read_table  # noqa: E402
from rlhf_core.data.synthetic import generate_demo_data  # noqa: E402

INVOCATION = uuid.uuid4().hex[:6]  # Ray Train resumes a run name it finds: names are this invocation's own
METHODS = ("grpo", "grpo-lora", "dpo", "ipo", "kto")
ONLINE = ("grpo", "grpo-lora")  # need the reward model and rollouts


def method_config(cfg: PipelineConfig, method: str, seed: int, dpo_overrides: dict,
                  lora_learning_rate: float | None = None) -> PipelineConfig:
    cfg = defences_off(cfg, answer_key=method in ONLINE)
    if method == "grpo":
        policy = cfg.policy.model_copy(update={"seed": seed, "min_accuracy_gain": -1.0})
    elif method == "grpo-lora":
        policy = cfg.policy.model_copy(update={
            "seed": seed, "min_accuracy_gain": -1.0, "lora": cfg.policy.lora.model_copy(update={"enabled": True}),
            "learning_rate": lora_learning_rate or cfg.policy.learning_rate})
    elif method == "kto":
        kto = cfg.policy.kto.model_copy(update=dpo_overrides)
        policy = cfg.policy.model_copy(update={"algorithm": "kto", "seed": seed, "min_accuracy_gain": -1.0, "kto": kto})
    else:
        dpo = cfg.policy.dpo.model_copy(update={"loss_type": "ipo" if method == "ipo" else "sigmoid", **dpo_overrides})
        policy = cfg.policy.model_copy(update={"algorithm": "dpo", "seed": seed, "min_accuracy_gain": -1.0, "dpo": dpo})
    return cfg.model_copy(update={"policy": PolicyConfig.model_validate(policy.model_dump())})  # checks batches


def run_method(cfg: PipelineConfig, files, sft_dir: Path, reward, work: Path, method: str) -> dict:
    from rlhf_core.distributed.offline_trainer import train_offline  # noqa: PLC0415
    from rlhf_core.distributed.policy_trainer import train_policy  # noqa: PLC0415
    from rlhf_core.training.stage_types import StageSite  # noqa: PLC0415

    p = cfg.policy
    evals = read_table(files.eval)
    pairs = read_table(files.preferences).to_dict("records")
    name = f"{method}-{p.seed}-{INVOCATION}"
    t0 = time.perf_counter()
    if method in ONLINE:
        sft_rows = read_table(files.sft).to_dict("records")
        prompts = list(dict.fromkeys([r["prompt"] for r in sft_rows] + [r["prompt"] for r in pairs]))
        result = train_policy(prompts, list(evals["prompt"]), list(evals["answer"]), sft_dir, reward.path, p,
                              StageSite(work / name, work / "ray", name))
    else:
        train, held_out = split_by_prompt(pairs, cfg.reward.eval_share, cfg.reward.seed)
        result = train_offline(train, held_out, list(evals["prompt"]), list(evals["answer"]), sft_dir, p,
                           StageSite(work / name, work / "ray", name))
    row = {"method": method, "seed": p.seed, "acc_before": result.accuracy_before, "acc_after": result.accuracy_after,
           "gain": result.accuracy_gain, "kl": result.kl_final, "steps": result.steps,
           "reward_s": reward.run.seconds if method in ONLINE else 0.0, "policy_s": time.perf_counter() - t0}
    row["total_s"] = row["reward_s"] + row["policy_s"]
    if method in ("dpo", "ipo"):
        row["pair_accuracy"] = result.evaluations[-1].get("eval/reward_accuracy")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "demo.yaml")
    parser.add_argument("--sft-dir", type=Path, help="an SFT policy to start from (e.g. runs/demo-*/models/sft)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--methods", nargs="+", default=["grpo", "dpo", "ipo"], choices=METHODS)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides of policy.dpo (or policy.kto for kto)")
    parser.add_argument("--lora-learning-rate", type=float,
                        help="the policy's learning rate with LoRA (grpo-lora; default policy.learning_rate)")
    parser.add_argument("--name", default="dpo_vs_grpo", help="result file name under bench/results/")
    parser.add_argument("--work", type=Path, help="keep data and models here (default: a temporary directory)")
    args = parser.parse_args()
    cfg = load_config(args.config)
    dpo_overrides = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    from rlhf_core.distributed.cluster import ray_session  # noqa: PLC0415
    from rlhf_core.distributed.reward_trainer import train_reward_model  # noqa: PLC0415
    from rlhf_core.training.stage_types import StageSite  # noqa: PLC0415

    rows: list[dict] = []
    columns = ["method", "seed", "acc_before", "acc_after", "gain", "kl", "pair_accuracy", "steps", "reward_s",
               "policy_s", "total_s"]
    with tempfile.TemporaryDirectory(prefix="dpo-vs-grpo-") as tmp, ray_session():
        work = args.work or Path(tmp)
        files = generate_demo_data(cfg.data.demo, work / "data")
        sft_dir = args.sft_dir or (work / "sft" if (work / "sft" / "config.json").exists() else None)
        sft_dir = sft_dir or sft_policy(cfg, files, work)
        reward = None
        if set(ONLINE) & set(args.methods):
            pairs = read_table(files.preferences).to_dict("records")
            train, held_out = split_by_prompt(pairs, cfg.reward.eval_share, cfg.reward.seed)
            reward = train_reward_model(train, held_out, sft_dir, cfg.reward,
                                        StageSite(work / "reward", work / "ray", f"reward-{INVOCATION}"))
        for seed in args.seeds:
            for method in args.methods:
                row = run_method(method_config(cfg, method, seed, dpo_overrides, args.lora_learning_rate), files, sft_dir, reward, work, method)
                rows.append(row)
                print(table([row], columns), flush=True)
                save(args.name, {"machine": machine(), "dpo": cfg.policy.dpo.model_dump() | dpo_overrides,
                                 "kto": cfg.policy.kto.model_dump() | dpo_overrides,
                                 "lora": cfg.policy.lora.model_dump() | {"learning_rate": args.lora_learning_rate},
                                 "rows": rows, "summary": method_rows(rows)})
    print("\nHeld-out accuracy over the SFT policy and wall time (mean ± sd over seeds):")
    print(table(method_rows(rows), ["method", "runs", "acc_before", "acc_after", "gain", "kl", "policy_s", "total_s"]))
    print(f"\nwritten {RESULTS / (args.name + '.json')}")


if __name__ == "__main__":
    main()
