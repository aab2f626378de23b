"""What checking every weight sync costs (`rlhf_core.distributed.policy_sync`), against the
sync itself and the step it guards.

The check scores `PROBE_ROWS` of the step's rollouts twice: by the engine (`probe`, teacher-
forced) and by the trainer (`batched_logprobs`, as it computes a step's old log-probs). For each
model a rollout engine (fp32, in this process as the trainer's is) generates one step of the
shape its config trains with, then, median of `--repeats`:

    probe_s     the engine's scoring of the probe rows
    trainer_s   the trainer's, in fp32 and in bf16
    sync_s      `sync_weights` of the whole state dict (file transport: the CPU default)
    step_s      the step's generation + one forward and backward pass over its rollouts: a floor
                under the trainer's step (which also scores, runs the reference and updates),
                so `check_share` = (probe_s + trainer_s) / step_s is an upper bound

Models: the demo's policy (`--demo`, from the newest demo run, else its size with random
weights) and SmolLM2-135M-Instruct (`--chat`, `make chat-model`). With a demo run under runs/,
the trainer's own GRPO steps are timed too (`--real-steps`): the median of `rollout/verify_s`
against the step. Peak resident memory of this process and its children is reported.

    .venv/bin/python bench/sync_check_cost.py
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import SIZES, PeakMemory, demo_grpo_steps, median, newest_demo_run, save, step_seconds, table, timed  # noqa: E402
from bench.weight_sync import train_pass  # noqa: E402

CHAT_DIR = Path(os.environ.get("CHAT_MODEL_DIR", Path.home() / ".cache/rlhf/models/smollm2-135m-instruct"))
SHAPES = {  # prompts x samples x response tokens of one step: configs/demo.yaml, configs/chat.yaml
    "demo": (32, 8, 8),
    "chat": (8, 8, 32),
}


def demo_model(tmp: Path) -> Path:
    run = newest_demo_run()
    if run is not None:
        return run / "models" / "sft"
    from bench.rollout_generation import demo_tokenizer  # noqa: PLC0415
    from rlhf_core.config import ModelConfig  # noqa: PLC0415
    from rlhf_core.models.llama import build_policy, save_pretrained_atomic  # noqa: PLC0415

    tok = demo_tokenizer()
    return save_pretrained_atomic(build_policy(ModelConfig(**SIZES["demo"], max_position_embeddings=64), tok, seed=0),
                                  tok, tmp / "demo")


def prompts_for(name: str, tokenizer, count: int) -> list[str]:
    from rlhf_core.data.synthetic import prompt_for  # noqa: PLC0415

    if name == "demo":
        return [prompt_for(a, (a * 37) % 100, 2) for a in range(count)]
    questions = [f"What is {a} plus {(a * 37) % 100}? Answer with the number." for a in range(count)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in questions]


def measure(name: str, model_dir: Path, repeats: int) -> dict:
    from rlhf_core.distributed.policy_sync import PROBE_ROWS, probe_of  # noqa: PLC0415
    from rlhf_core.models.llama import load_policy  # noqa: PLC0415
    from rlhf_core.rollout.vllm_engine import RolloutEngine  # noqa: PLC0415
    from rlhf_core.training.policy_batch import build_batch  # noqa: PLC0415
    from rlhf_core.training.policy_step import batched_logprobs  # noqa: PLC0415
    from rlhf_core.training.precision import computing_in  # noqa: PLC0415

    prompts, samples, tokens = SHAPES[name]
    model = load_policy(model_dir)
    context = min(256, model.config.max_position_embeddings)
    with RolloutEngine(model_dir, dtype="float32", seed=0, max_model_len=context, max_num_seqs=prompts * samples) as engine:
        texts = prompts_for(name, engine.tokenizer, prompts)
        rollouts: list = []

        def generate():
            rollouts[:] = engine.generate(texts, n=samples, max_tokens=tokens, min_tokens=tokens, seed=0)

        generate_s = median(timed(generate, 3))
        probe = probe_of(rollouts)
        probe_s = median(timed(lambda: engine.probe(probe.prompt_ids, probe.response_ids), repeats))
        batch = build_batch(probe.rows, engine.tokenizer.pad_token_id or 0)
        trainer_s = {}
        for precision in ("fp32", "bf16"):
            def score(precision=precision):
                with computing_in(precision, torch.device("cpu")):
                    batched_logprobs(model, batch, 1.0, PROBE_ROWS)
            trainer_s[precision] = median(timed(score, repeats))
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        sync_s = median(timed(lambda: engine.sync_weights(state), repeats))
    train_s = median(timed(lambda: train_pass(model, rollouts, micro=16), 2))
    step_s = generate_s + train_s + sync_s
    check_s = probe_s + trainer_s["fp32"]
    return {"model": name, "params": sum(p.numel() for p in model.parameters()), "step_shape": f"{prompts}x{samples}x{tokens}",
            "probe_tokens": probe.tokens, "probe_s": probe_s, "trainer_fp32_s": trainer_s["fp32"],
            "trainer_bf16_s": trainer_s["bf16"], "check_s": check_s, "sync_s": sync_s, "step_s": step_s,
            "check_vs_sync": check_s / sync_s, "check_share": check_s / step_s}


def real_demo_steps(steps: int) -> dict | None:
    """The demo GRPO stage's own steps: medians over steps of `rollout/verify_s`, `timing/sync`
    and the step's wall time."""
    found = demo_grpo_steps(steps, "sync-check")
    if found is None:
        return None
    run_dir, history = found
    step = [step_seconds(m) for m in history]
    verify = [m["rollout/verify_s"] for m in history]
    return {"run_dir": run_dir.name, "steps": len(step), "verify_s": median(verify),
            "sync_s": median([m["timing/sync"] for m in history]), "step_s": median(step),
            "verify_share": median([a / b for a, b in zip(verify, step, strict=True)]),
            "verify_gap_max": max(m["rollout/verify_gap"] for m in history)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["demo", "chat"], choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--real-steps", type=int, default=8, help="demo GRPO steps of the trainer itself (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    rows = []
    with PeakMemory(every=0.5, driver="sync_check_cost") as memory, tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model_dir = demo_model(Path(tmp)) if name == "demo" else CHAT_DIR
            if not (model_dir / "config.json").is_file():
                print(f"{name}: no model at {model_dir} (run `make chat-model`); skipped")
                continue
            rows.append(measure(name, model_dir, args.repeats))
            print(table(rows[-1:], list(rows[-1])), flush=True)
        real = real_demo_steps(args.real_steps) if args.real_steps else None
    print(f"\nThe check of one weight sync (median of {args.repeats}) against the sync and a step's floor:")
    print(table(rows, ["model", "params", "step_shape", "probe_tokens", "check_s", "trainer_bf16_s", "sync_s", "step_s",
                       "check_vs_sync", "check_share"]))
    if real is not None:
        print(f"\nThe trainer's own demo GRPO steps ({real['steps']}, {real['run_dir']}), median: check "
              f"{real['verify_s'] * 1e3:.0f} ms, sync {real['sync_s'] * 1e3:.0f} ms, step {real['step_s']:.2f} s: "
              f"the check is {real['verify_share']:.1%} of the step; largest gap {real['verify_gap_max']:.2g}")
    peaks = memory.by_role()
    print("\npeak resident memory: " + ", ".join(f"{p['process']} {p['peak_rss_gib']} GiB" for p in peaks))
    print(f"\nwritten {save('sync_check_cost', {'repeats': args.repeats, 'rows': rows, 'real_demo': real, 'peak_rss': peaks})}")


if __name__ == "__main__":
    main()
