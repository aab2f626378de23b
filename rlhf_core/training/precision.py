"""Which precision the policy stage computes in: fp32, or bf16 mixed precision.

In bf16 mode the weights, gradients and optimizer state stay fp32; the forward passes of the
actor, the reference and the critic (and so their backward passes) run under
`torch.autocast(dtype=torch.bfloat16)`: matrix multiplies in bf16, reductions such as
softmax and the losses in fp32. That is mixed-precision training as GPUs run it; it needs no
loss scaling (bf16 has fp32's exponent range) and leaves checkpoints, weight sync and the
saved model as they are.

bf16 is faster only where the hardware multiplies bf16 at a higher rate than fp32: GPUs with
bf16 support, and CPUs whose bf16 kernels outrun their fp32 ones. That is not told by a CPU
flag alone (CPUs with AVX-512 bf16 but no AMX were measured slower in bf16, others faster), so
`auto` measures on the machine at hand: a bf16 and an fp32 matrix multiply, bf16 chosen when
it is at least `MIN_SPEEDUP` times as fast (`bench/precision.py` measures the same more fully).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Literal

import torch

Precision = Literal["fp32", "bf16"]
MIN_SPEEDUP = 1.3  # bf16 must win clearly: a measurement on a shared machine is noisy
PROBE_SIZE = 512


def matmul_seconds(dtype: torch.dtype, size: int = PROBE_SIZE, repeats: int = 5) -> float:
    """The fastest of `repeats` timings of four size x size matrix multiplies in `dtype` (CPU)."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b  # warm-up: kernel selection, first-touch allocation
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        best = min(best, time.perf_counter() - start)
    return best


def resolve_precision(requested: str, use_gpu: bool,
                      measure: Callable[[torch.dtype], float] = matmul_seconds) -> Precision:
    """`requested` ("auto", "fp32" or "bf16") -> the precision to train in. auto: bf16 on a GPU
    that supports it, on a CPU when `measure` (seconds of the same work in a dtype) finds bf16
    at least MIN_SPEEDUP times faster; else fp32."""
    if requested in ("fp32", "bf16"):
        return requested  # type: ignore[return-value]
    if requested != "auto":
        raise ValueError(f"precision {requested!r}: auto, fp32 or bf16")
    if use_gpu:
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if measure(torch.float32) >= MIN_SPEEDUP * measure(torch.bfloat16) else "fp32"


@contextmanager
def computing_in(precision: Precision, device: torch.device | str = "cpu") -> Iterator[None]:
    """Forward passes inside run in `precision` (bf16: autocast; fp32: as they are)."""
    device_type = torch.device(device).type
    context = torch.autocast(device_type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    with context:
        yield
