"""Rollout generation: our vLLM engine path (`RolloutEngine.generate`) against Hugging Face
`generate` on the same policy, prompts and sampling settings, in one run.

Both sample at temperature 1 (top-p 1, no top-k) in float32 on the CPU, every completion
exactly `--tokens` long (end-of-sequence suppressed), groups of 8 samples per prompt as in
GRPO. HF runs one batch of all prompts with `num_return_sequences`, on as many torch threads
as the machine has cores; the engine is started once and its start-up is reported apart.
Policies have random weights: throughput does not depend on what the weights say.

    .venv/bin/python bench/rollout_generation.py            # demo and 25M sizes, 64-1,024 completions

About 25 minutes on 2 cores, most of it the 25M policy at 1,024 completions (`--prompts 8 32`
for 64 and 256 only).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import SIZES, median, save, table, timed  # noqa: E402
from rlhf_core.config import ModelConfig  # noqa: E402
from rlhf_core.data.synthetic import prompt_for  # noqa: E402
from rlhf_core.models.llama import build_policy, num_parameters, save_pretrained_atomic  # noqa: E402
from rlhf_core.tokenizer import train_tokenizer  # noqa: E402

GROUP = 8


def demo_tokenizer():
    return train_tokenizer([f"{a:02d}+{b:02d}={a + b:03d}" for a in range(100) for b in range(100)], vocab_size=320)


def hf_generate(model, tok, prompts: list[str], tokens: int) -> int:
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, min_new_tokens=tokens,
                             max_new_tokens=tokens, num_return_sequences=GROUP, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    return out.shape[0] * (out.shape[1] - enc["input_ids"].shape[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["demo", "25m"], choices=list(SIZES))
    parser.add_argument("--prompts", nargs="+", type=int, default=[8, 32, 64, 128], help="prompts per batch (x8 samples)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from rlhf_core.rollout.vllm_engine import RolloutEngine  # noqa: PLC0415 (spawn: under __main__)

    torch.set_num_threads(os.cpu_count() or 1)
    tok = demo_tokenizer()
    prompts_all = [prompt_for(i % 100, (i * 37 + i // 100) % 100, 2) for i in range(max(args.prompts))]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            cfg = ModelConfig(**SIZES[size], max_position_embeddings=args.tokens + 16)
            model = build_policy(cfg, tok, seed=0).eval()
            model_dir = save_pretrained_atomic(model, tok, Path(tmp) / size)
            engine = RolloutEngine(model_dir, dtype="float32", seed=0, max_model_len=cfg.max_position_embeddings,
                                   max_num_seqs=max(args.prompts) * GROUP)
            try:
                for n in args.prompts:
                    prompts = prompts_all[:n]
                    completions = n * GROUP
                    hf_tokens = hf_generate(model, tok, prompts, args.tokens)
                    ours = engine.generate(prompts, n=GROUP, max_tokens=args.tokens, min_tokens=args.tokens, seed=0)
                    our_tokens = sum(len(r.response_token_ids) for r in ours)
                    assert hf_tokens == our_tokens == completions * args.tokens, (hf_tokens, our_tokens)
                    hf_s = median(timed(lambda: hf_generate(model, tok, prompts, args.tokens), args.repeats))
                    our_s = median(timed(lambda: engine.generate(prompts, n=GROUP, max_tokens=args.tokens,
                                                                 min_tokens=args.tokens), args.repeats))
                    rows.append({
                        "size": size, "params": num_parameters(model), "completions": completions,
                        "tokens": our_tokens, "hf_tokens_per_s": our_tokens / hf_s, "ours_tokens_per_s": our_tokens / our_s,
                        "speedup": hf_s / our_s, "hf_s": hf_s, "ours_s": our_s,
                        "engine_start_s": engine.start_seconds,
                    })
                    print(table(rows[-1:], list(rows[-1])), flush=True)
            finally:
                engine.close()
    print("\nRollout generation, tokens/s (median of %d), completions of %d tokens:" % (args.repeats, args.tokens))
    print(table(rows, ["size", "params", "completions", "hf_tokens_per_s", "ours_tokens_per_s", "speedup",
                       "engine_start_s"]))
    print(f"\nwritten {save('rollout_generation', {'tokens': args.tokens, 'group': GROUP, 'rows': rows})}")


if __name__ == "__main__":
    main()
