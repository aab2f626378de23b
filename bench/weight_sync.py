"""Weight-sync latency as the policy grows, and its share of an RL step.

For each size, a rollout engine is started on the policy and `sync_weights` pushes a full
state dict into it (the path the trainer takes every step on CPU: safetensors in /dev/shm,
loaded in place by the engine's worker), and, beside it, streamed without a file through vLLM's
weight-transfer API over gloo (`stream_sync_s`; the same protocol is NCCL on GPUs). The step it is compared with is measured in the same run:
the rollouts of one demo-shaped GRPO step (32 prompts x 8 samples of `--tokens` tokens)
through the engine, plus one forward and backward pass of the trainer's policy over them.
That step is a floor under the trainer's (which also scores, runs the reference and old
policies and makes several optimizer updates), so its share is an upper bound.

At the demo size the trainer's own step is measured too (`--real-steps`, given a demo run
under runs/ from `make demo`): the demo's GRPO stage, from its SFT policy and reward model,
on 2 Ray workers, reporting per step `timing/sync` (rank 0 gathering the actor and pushing it
into the engine) against the step's wall time; the median over the steps is printed.

    .venv/bin/python bench/weight_sync.py                     # demo, 25M, 100M
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import SIZES, demo_grpo_steps, median, save, step_seconds, table, timed  # noqa: E402
from bench.rollout_generation import GROUP, demo_tokenizer  # noqa: E402
from rlhf_core.config import ModelConfig  # noqa: E402
from rlhf_core.data.synthetic import prompt_for  # noqa: E402
from rlhf_core.models.llama import build_policy, num_parameters, save_pretrained_atomic  # noqa: E402


def train_pass(model, rollouts, micro: int = 64) -> None:
    """One forward + backward over the step's sequences, in micro-batches (the trainer's work)."""
    rows = [r.prompt_token_ids + r.response_token_ids for r in rollouts]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    model.train()
    for i in range(0, len(rows), micro):
        logits = model(input_ids=ids[i : i + micro]).logits
        torch.log_softmax(logits.float(), -1).mean().backward()
    model.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["demo", "25m", "100m"], choices=list(SIZES))
    parser.add_argument("--tokens", type=int, default=8, help="completion length (the demo's max_new_tokens)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--real-steps", type=int, default=10,
                        help="demo GRPO steps of the trainer itself to time (0: none)")
    args = parser.parse_args()
    from rlhf_core.rollout.vllm_engine import RolloutEngine  # noqa: PLC0415
    from rlhf_core.rollout.weight_sync import SafetensorsFileTransport  # noqa: PLC0415
    from rlhf_core.rollout.weight_transfer import GLOO_BACKEND, StreamingTransport  # noqa: PLC0415

    torch.set_num_threads(os.cpu_count() or 1)
    tok = demo_tokenizer()
    prompts = [prompt_for(a, (a * 37) % 100, 2) for a in range(args.prompts)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            cfg = ModelConfig(**SIZES[size], max_position_embeddings=64)
            model = build_policy(cfg, tok, seed=0)
            model_dir = save_pretrained_atomic(model, tok, Path(tmp) / size)
            stream, file = StreamingTransport(GLOO_BACKEND), SafetensorsFileTransport()
            engine = RolloutEngine(model_dir, dtype="float32", seed=0, max_model_len=64, transport=stream)
            try:
                state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                stream_s = median(timed(lambda: engine.sync_weights(state), args.repeats))  # no file: gloo
                engine.transport = file  # what a CPU run uses
                sync_s = median(timed(lambda: engine.sync_weights(state), args.repeats))
                rollouts = []

                def generate():
                    rollouts[:] = engine.generate(prompts, n=GROUP, max_tokens=args.tokens, min_tokens=args.tokens)

                gen_s = median(timed(generate, 3))
                train_s = median(timed(lambda: train_pass(model, rollouts), 3))
            finally:
                engine.close()  # closes the file transport, the engine's last
                stream.close()
            step_s = gen_s + train_s + sync_s
            rows.append({"size": size, "params": num_parameters(model), "sync_s": sync_s, "stream_sync_s": stream_s,
                         "generate_s": gen_s, "train_pass_s": train_s, "step_s": step_s,
                         "sync_share": sync_s / step_s, "MB": sum(v.numel() * 4 for v in state.values()) / 1e6})
            print(table(rows[-1:], list(rows[-1])), flush=True)
    print(f"\nWeight sync (median of {args.repeats}) and its share of one step "
          f"({args.prompts} prompts x {GROUP} samples x {args.tokens} tokens + a train pass):")
    print(table(rows, ["size", "params", "MB", "sync_s", "stream_sync_s", "step_s", "sync_share"]))
    real = real_demo_steps(args.real_steps) if args.real_steps else None
    if real is not None:
        print(f"\nThe trainer's own demo GRPO step ({real['steps']} steps, {real['run_dir']}), median: sync "
              f"{real['sync_s'] * 1e3:.0f} ms of {real['step_s']:.2f} s = {real['sync_share']:.1%}")
    print(f"\nwritten {save('weight_sync', {'tokens': args.tokens, 'prompts': args.prompts, 'rows': rows, 'real_demo': real})}")


def real_demo_steps(steps: int) -> dict | None:
    """The demo GRPO stage's own steps: the median over steps of `timing/sync` (rank 0 gathering
    the actor and pushing it into the engine) and of the step's wall time, and of their ratio."""
    found = demo_grpo_steps(steps, "sync")
    if found is None:
        return None
    run_dir, history = found
    sync = [m["timing/sync"] for m in history]
    step = [step_seconds(m) for m in history]
    return {"run_dir": run_dir.name, "steps": len(step), "sync_s": median(sync), "step_s": median(step),
            "sync_share": median([a / b for a, b in zip(sync, step, strict=True)])}


if __name__ == "__main__":
    main()
