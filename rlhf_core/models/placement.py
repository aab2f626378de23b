"""Where the frozen models of a training worker live: on the trainer's device, so that every
tensor a forward pass meets is where its model is. On a GPU they are kept in bf16 (half the
memory of fp32; they are never trained and their outputs are cast to fp32 where they are
used); on the CPU they stay as loaded, so the CPU path computes exactly what it always did.
Also which tensors a module holds, in the order every rank walks them, and which of them are
ZeRO-3 shards: what a trainer and the rollout engine's weight stream both need."""
from __future__ import annotations

import torch


def frozen_dtype(device: torch.device | str) -> torch.dtype | None:
    """bf16 for a frozen model on a CUDA device; None (keep the loaded dtype) elsewhere."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else None


def frozen_on(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """`model` in eval mode without gradients, on `device`, in `frozen_dtype(device)`."""
    return model.to(device=device, dtype=frozen_dtype(device)).eval().requires_grad_(False)


def module_entries(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's parameters and buffers by state-dict name, each tensor once (a tied head
    rides with the embeddings, as `weight_sync.without_tied_copies`): the order every rank gathers in."""
    seen: set[int] = set()
    out = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append((name, tensor))
    return out


def is_partitioned(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "ds_id")  # a ZeRO-3 parameter: its data is a shard until gathered
