"""Where the frozen models of a training worker live: on the trainer's device, so that every
tensor a forward pass meets is where its model is. On a GPU they are kept in bf16 (half the
memory of fp32; they are never trained and their outputs are cast to fp32 where they are
used); on the CPU they stay as loaded, so the CPU path computes exactly what it always did."""
from __future__ import annotations

import torch


def frozen_dtype(device: torch.device | str) -> torch.dtype | None:
    """bf16 for a frozen model on a CUDA device; None (keep the loaded dtype) elsewhere."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else None


def frozen_on(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """`model` in eval mode without gradients, on `device`, in `frozen_dtype(device)`."""
    return model.to(device=device, dtype=frozen_dtype(device)).eval().requires_grad_(False)
