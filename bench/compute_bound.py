"""How fast can any generator be here? fp32 matrix-multiply throughput of this CPU, and the
tokens/s ceiling it puts on decoding a policy (about 2 x parameters FLOPs per token).

At 25M parameters both vLLM and Hugging Face `generate` reach about 40-45% of this ceiling
on two cores (the rest goes to attention, norms, sampling and Python); at the demo size the
ceiling is far away and per-step overheads decide.

    .venv/bin/python bench/compute_bound.py
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import median, save, table, timed  # noqa: E402

# (batch of tokens, in, out): the shapes of one decode step of the 25M policy at 64 and 256
# sequences (hidden 512, MLP 1408)
SHAPES = [(64, 512, 1408), (256, 512, 1408), (64, 512, 512), (256, 512, 512)]


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    rows = []
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        seconds = median(timed(lambda a=a, b=b: [a @ b for _ in range(200)], repeats=5)) / 200
        rows.append({"tokens": m, "k": k, "n": n, "gflop_per_s": 2 * m * k * n / seconds / 1e9})
    peak = max(r["gflop_per_s"] for r in rows)
    ceiling = {size: peak * 1e9 / (2 * params) for size, params in (("demo", 919_424), ("25m", 25_964_032))}
    print(table(rows, list(rows[0])))
    print(f"\nbest fp32 GEMM {peak:.0f} GFLOP/s on {torch.get_num_threads()} threads -> decode ceiling "
          f"{ceiling['25m']:,.0f} tokens/s at 25M parameters, {ceiling['demo']:,.0f} at the demo size")
    print(f"written {save('compute_bound', {'rows': rows, 'peak_gflop_per_s': peak, 'tokens_per_s_ceiling': ceiling})}")


if __name__ == "__main__":
    main()
