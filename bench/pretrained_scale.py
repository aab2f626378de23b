"""The policy stage on a pretrained-format model of about 100-150M parameters, the largest this
2-core, 24 GiB machine takes through GRPO in reasonable time.

The model is made locally (random weights, a Llama with tied embeddings and grouped-query
attention, a 32,000-row vocabulary, a chat template), saved as Hugging Face writes one, and
made the run's own by `rlhf_core.models.pretrained.materialise` exactly as `model.pretrained`
does. Its reward model is its backbone with a fresh head (the scores are not trained: the
timing is the point). A few GRPO steps run on conversational prompts through
`train_policy` (Ray Train + DeepSpeed, two workers, rollouts from vLLM's CPU engine).

Reported: seconds per RL step and per phase (from the stage's own metrics), weight-sync
seconds, and peak resident memory of every process of the run (sampled every 0.5 s).

`--variants` runs the same stage once per way of training the actor, on the same model and
prompts, to compare memory and time:

    full      every weight trains (the default)
    lora      LoRA adapters on every linear layer (`policy.lora`, rank 8): optimizer state for
              the adapters only, and no reference copy (the actor with its adapters off)
    +gc       gradient checkpointing (`policy.gradient_checkpointing`): activations recomputed
              layer by layer in the backward pass
    +bf16     bf16 mixed precision (`policy.precision: bf16`); the others run in fp32

    .venv/bin/python bench/pretrained_scale.py                 # ~113M parameters
    .venv/bin/python bench/pretrained_scale.py --layers 8      # a smaller one
    .venv/bin/python bench/pretrained_scale.py --variants full full+gc lora lora+gc --name policy_memory

Writes bench/results/pretrained_scale.json (or `--name`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import PeakMemory, save, table  # noqa: E402
from rlhf_core.testing.sinks import JsonlSink  # noqa: E402

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def make_model(out: Path, layers: int, hidden: int, vocab: int) -> Path:
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: PLC0415

    from rlhf_core.tokenizer import train_tokenizer  # noqa: PLC0415

    texts = [f"<|user|>\nWhat is {a} plus {b}?</s>\n<|assistant|>\n{a + b}</s>" for a in range(60) for b in range(60)]
    tok = train_tokenizer(texts, vocab_size=2000)
    tok.chat_template = TEMPLATE
    config = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                         vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=8, help="policy.micro_batch_size (sequences per pass)")
    parser.add_argument("--variants", nargs="+", default=["full"], choices=VARIANTS)
    parser.add_argument("--name", default="pretrained_scale", help="result file name under bench/results/")
    args = parser.parse_args()
    from rlhf_core.chat import render_prompt  # noqa: PLC0415
    from rlhf_core.config import PolicyConfig  # noqa: PLC0415
    from rlhf_core.distributed.policy_trainer import train_policy  # noqa: PLC0415
    from rlhf_core.training.stage_types import StageSite  # noqa: PLC0415
    from rlhf_core.models.pretrained import inspect_pretrained, materialise, training_bytes  # noqa: PLC0415
    from rlhf_core.models.reward import RewardStats, reward_model_from_base, save_reward_model  # noqa: PLC0415
    from rlhf_core.tokenizer import load_tokenizer  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="pretrained-scale-") as tmp:
        tmp = Path(tmp)
        base = materialise(str(make_model(tmp / "user-model", args.layers, args.hidden, args.vocab)), tmp / "base")
        info = inspect_pretrained(base)
        tokenizer = load_tokenizer(base)
        save_reward_model(reward_model_from_base(base), tokenizer, tmp / "reward", RewardStats(0.0, 1.0))
        prompts = [render_prompt(tokenizer, [{"role": "user", "content": f"What is {a} plus {b}?"}])
                   for a in range(40) for b in range(3)]
        runs = []
        for variant in args.variants:
            options = variant.split("+")[1:]
            cfg = PolicyConfig(algorithm="grpo", num_workers=args.workers, steps=args.steps, prompts_per_step=8,
                               precision="bf16" if "bf16" in options else "fp32",
                               grpo={"group_size": 4}, max_new_tokens=16, minibatch_size=32,
                               micro_batch_size=args.micro_batch, epochs_per_step=1, eval_every=args.steps,
                               checkpoint_every=args.steps, verifiable_reward=None, verifiable_reward_weight=0.0,
                               reward_model_weight=1.0, lora={"enabled": variant.startswith("lora")},
                               gradient_checkpointing="gc" in options)
            sink = JsonlSink(tmp / f"metrics-{variant}.jsonl")
            start = time.perf_counter()
            with PeakMemory() as memory:
                result = train_policy(prompts, prompts[:16], [], base, tmp / "reward", cfg,
                                      StageSite(tmp / f"policy-{variant}", tmp / "ray", f"scale-{variant}", sink))
            wall = time.perf_counter() - start
            records = [json.loads(line) for line in Path(sink.path).read_text().splitlines()]
            runs.append(figures_of(variant, info, args, cfg, result, records, wall, memory, training_bytes))
            print(f"{variant}: trainer peak {runs[-1]['trainer_peak_gib']} GiB, "
                  f"{runs[-1]['seconds_per_step']} s/step", flush=True)
    if len(runs) == 1:
        figures = runs[0]
        print(table([{k: v for k, v in figures.items() if not isinstance(v, (dict, list))}],
                    [k for k, v in figures.items() if not isinstance(v, (dict, list))]))
        print("phases (s, median):", figures["phases_s"])
        print(table(figures["peak_rss"], ["process", "peak_rss_gib"]))
        print("written:", save(args.name, figures))
        return
    columns = ["variant", "trainer_peak_gib", "engine_peak_gib", "seconds_per_step", "update_s", "weight_sync_s",
               "estimated_gib"]
    rows = [{**r, "update_s": r["phases_s"].get("timing/update")} for r in runs]
    print(table(rows, columns))
    print("written:", save(args.name, {"model": {k: runs[0][k] for k in MODEL_KEYS}, "micro_batch": args.micro_batch,
                                       "variants": runs}))


VARIANTS = ("full", "full+gc", "lora", "lora+gc", "full+bf16", "lora+gc+bf16")
MODEL_KEYS = ("parameters_m", "layers", "hidden", "vocab", "kv_heads", "tied_embeddings")


def figures_of(variant, info, args, cfg, result, records, wall, memory, training_bytes) -> dict:
    """One run's figures: its model, seconds per step and phase, and peak memory by process."""
    steps = [r for r in records if any(k.startswith("policy/step_time_s/") for k in r)]  # not the evaluations
    timed = steps[1:] or steps  # the first step pays for warm-up
    step_s = [max(v for k, v in s.items() if k.startswith("policy/step_time_s/")) for s in timed]
    phases = sorted({k for s in timed for k in s if k.startswith("timing/")})
    peaks = memory.by_role()
    figures = {
        "variant": variant,
        "parameters_m": round(info.num_parameters / 1e6, 1), "layers": info.num_layers, "hidden": info.hidden_size,
        "vocab": info.vocab_size, "kv_heads": info.num_kv_heads, "tied_embeddings": info.tie_word_embeddings,
        "workers": args.workers, "rollouts_per_step": cfg.rollouts_per_step, "max_new_tokens": cfg.max_new_tokens,
        "steps": result.steps, "seconds_per_step": round(statistics.median(step_s), 1),
        "first_step_s": round(max(v for k, v in steps[0].items() if k.startswith("policy/step_time_s/")), 1),
        "weight_sync_s": round(statistics.median(s["rollout/sync_s"] for s in timed), 3),
        "phases_s": {p: round(statistics.median(s[p] for s in timed if p in s), 2) for p in phases},
        "stage_wall_s": round(wall, 1),
        "estimated_gib": None if cfg.lora.enabled else round(training_bytes(  # the preflight's full-weight estimate
            info.num_parameters, workers=args.workers, with_critic=False, reward_parameters=info.num_parameters) / 2**30, 1),
        "peak_rss": peaks,
        # the largest Ray Train worker (actor, reference, reward model, optimizer state,
        # activations) and the largest vLLM process
        "trainer_peak_gib": max((r["peak_rss_gib"] for r in peaks if r["process"].startswith("Ray Train worker")),
                                default=None),
        "engine_peak_gib": max((r["peak_rss_gib"] for r in peaks if r["process"].startswith("vLLM")), default=None),
    }
    return figures


if __name__ == "__main__":
    main()
