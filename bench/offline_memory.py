"""What a DPO (or KTO) worker holds, phase by phase, on the chat task's real model, beside the
preflight's estimate of the stage.

The policy stage of `configs/chat.yaml` with `policy.algorithm` set (SmolLM2-135M-Instruct, LoRA,
one worker) runs through `train_offline` (Ray Train + DeepSpeed) on the chat task's pairs,
rendered with the model's chat template and split as the data stage does, then the end of the
stage whole (greedy accuracy of the reference and the policy on the 200 held-out questions, the
loss on the held-out pairs, the sampled KL, the save). The whole stage takes about 26 minutes
here; `--rows 128` (4 steps over 2 epochs) about 6, and reaches nearly the same peak.

Reported: rank 0's peak resident memory by the end of each phase (loaded, trained, evaluated:
the stage's own `peak_memory`), every process's peak sampled from outside, the stage's seconds,
and the preflight's estimate (`stage_estimates`) with its ratio to the measured peak.

    .venv/bin/python bench/offline_memory.py --name offline_memory_full   # dpo, every training pair
    .venv/bin/python bench/offline_memory.py --rows 128                   # 4 steps
    .venv/bin/python bench/offline_memory.py --algorithm kto --rows 128 --name offline_memory_kto

Needs the converted model (`make chat-model`). Writes bench/results/offline_memory.json (or `--name`).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, PeakMemory, machine, save, table  # noqa: E402

MODEL = Path("~/.cache/rlhf/models/smollm2-135m-instruct").expanduser()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithm", default="dpo", choices=["dpo", "kto"])
    parser.add_argument("--rows", type=int, help="training pairs, the first of the split (default: all of them)")
    parser.add_argument("--model", type=Path, default=MODEL, help="the converted SmolLM2 directory (make chat-model)")
    parser.add_argument("--name", default="offline_memory")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"{args.model} holds no converted model: run `make chat-model`")

    import ray  # noqa: PLC0415

    from rlhf_core.config import load_config  # noqa: PLC0415
    from rlhf_core.data.chat_task import generate_chat_task  # noqa: PLC0415
    from rlhf_core.data.pairs import split_by_prompt  # noqa: PLC0415
    from rlhf_core.data.prepare import Limits, prepare_inputs  # noqa: PLC0415
    from rlhf_core.data.schema import read_table  # noqa: PLC0415
    from rlhf_core.distributed.cluster import shutdown_ray  # noqa: PLC0415
    from rlhf_core.distributed.offline_trainer import train_offline  # noqa: PLC0415
    from rlhf_core.training.stage_types import StageSite  # noqa: PLC0415
    from rlhf_core.models.pretrained import inspect_pretrained, stage_estimates  # noqa: PLC0415
    from rlhf_core.tokenizer import load_tokenizer  # noqa: PLC0415

    cfg = load_config(REPO / "configs" / "chat.yaml",
                      overrides=[f"model.pretrained={args.model}", f"policy.algorithm={args.algorithm}"])
    with tempfile.TemporaryDirectory(prefix="offline-memory-") as tmp:
        work = Path(tmp)
        data = generate_chat_task(work / "data", seed=0)
        prepared = prepare_inputs(data.preferences, data.eval, None, None, load_tokenizer(args.model),
                                  Limits(pair_tokens=cfg.reward.max_length), work / "prepared")
        pairs = read_table(prepared.preferences)[["prompt", "chosen", "rejected"]].to_dict("records")
        train, held_out = split_by_prompt(pairs, cfg.reward.eval_share, cfg.reward.seed)  # as the data stage splits
        evals = read_table(prepared.eval).to_dict("records")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
        try:
            start = time.perf_counter()
            with PeakMemory(every=0.5, driver=Path(__file__).name) as memory:
                result = train_offline(train[: args.rows or len(train)], held_out, [r["prompt"] for r in evals],
                                       [r["answer"] for r in evals], args.model, cfg.policy,
                                       StageSite(work / "policy", work / "ray", "policy"),
                                       answer_checker=cfg.data.answer_checker)
            wall = time.perf_counter() - start
        finally:
            shutdown_ray()
    info = inspect_pretrained(args.model)
    estimate = stage_estimates(info, cfg)["policy"] / 2**30
    measured = max(result.peak_memory.values())
    d = cfg.policy.offline
    figures = {
        "machine": machine(engine=False), "model": str(args.model), "algorithm": args.algorithm,
        "settings": {"rows": min(args.rows or len(train), len(train)), "held_out_pairs": len(held_out),
                     "eval_prompts": len(evals),
                     "batch_size": d.batch_size, "micro_batch_size": d.micro_batch_size, "max_length": d.max_length,
                     "lora": cfg.policy.lora.enabled, "gradient_checkpointing": cfg.policy.gradient_checkpointing},
        "steps": result.steps, "stage_seconds": round(result.run.seconds, 1), "wall_s": round(wall, 1),
        "rank0_peak_gib_by_phase": result.peak_memory, "peak_rss": memory.by_role(),
        "preflight_policy_stage_gib": round(estimate, 2), "estimate_over_measured": round(estimate / measured, 3),
    }
    print(table([{"phase": k, "peak_rss_gib": v} for k, v in result.peak_memory.items()], ["phase", "peak_rss_gib"]))
    print(table(figures["peak_rss"], ["process", "peak_rss_gib"]))
    print(f"preflight estimate {estimate:.2f} GiB, measured peak {measured:.2f} GiB: "
          f"ratio {figures['estimate_over_measured']}")
    print("written:", save(args.name, figures))


if __name__ == "__main__":
    main()
