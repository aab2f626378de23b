"""Is bf16 faster than fp32 on this machine? A matrix multiply and one training step (forward
and backward) of a Llama policy, in fp32 and in bf16 (weights in fp32 under
`torch.autocast(dtype=bfloat16)`, the way mixed-precision training runs), on every core.

bf16 halves memory traffic but is only faster where the CPU multiplies bf16 natively at a
higher rate than fp32 (AMX tiles; GPUs); with AVX-512 bf16 alone it can be slower. The
pipeline trains in fp32; this script is how to check a machine before changing that.

    .venv/bin/python bench/precision.py
    .venv/bin/python bench/precision.py --layers 4 --hidden 512 --batch 16 --length 64

Writes bench/results/precision.json.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from bench.common import machine, median, save, table, timed  # noqa: E402


def cpu_flags() -> list[str]:
    """The CPU's bf16-related flags (Linux): avx512_bf16, amx_bf16, amx_tile."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if "bf16" in f or f.startswith("amx"))


def matmul_gflops(n: int, dtype: torch.dtype, repeats: int) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    seconds = median(timed(lambda: [a @ b for _ in range(10)], repeats=repeats)) / 10
    return 2 * n**3 / seconds / 1e9


def train_step_seconds(model: torch.nn.Module, ids: torch.Tensor, bf16: bool, repeats: int) -> float:
    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    return median(timed(step, repeats=repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    rows = []
    for n in (1024, 2048):
        fp32, bf16 = matmul_gflops(n, torch.float32, args.repeats), matmul_gflops(n, torch.bfloat16, args.repeats)
        rows.append({"what": f"matmul {n}x{n} (GFLOP/s)", "fp32": round(fp32, 1), "bf16": round(bf16, 1),
                     "bf16_speedup": round(bf16 / fp32, 2)})
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 64, max_position_embeddings=args.length)
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(0, args.vocab, (args.batch, args.length))
    fp32, bf16 = (train_step_seconds(model, ids, flag, args.repeats) for flag in (False, True))
    parameters_m = sum(p.numel() for p in model.parameters()) / 1e6
    rows.append({"what": f"train step, {parameters_m:.1f}M Llama, {args.batch}x{args.length} tokens (s)",
                 "fp32": round(fp32, 3), "bf16": round(bf16, 3), "bf16_speedup": round(fp32 / bf16, 2)})
    flags = cpu_flags()
    print(f"CPU flags: {' '.join(flags) or 'none with bf16'}; {torch.get_num_threads()} threads")
    print(table(rows, ["what", "fp32", "bf16", "bf16_speedup"]))
    print("bf16_speedup > 1: bf16 is faster here")
    print(f"written {save('precision', {'machine': machine(), 'cpu_flags': flags, 'rows': rows})}")


if __name__ == "__main__":
    main()
