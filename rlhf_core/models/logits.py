"""Logits from a given column on: the LM head run only where a caller reads its output.

A causal LM's head maps every position's hidden state to a (V,)-row of logits; for a batch of
prompts and responses the (B, L, V) result, and its gradient, is the largest tensor of a
training step (32,000 x 4 bytes per position in fp32). Policy log-probs and KLs read only the
columns that predict response tokens, which start at the shortest prompt's last token, so the
head runs from there (transformers' `logits_to_keep`: the last `keep` positions).
"""
from __future__ import annotations

import inspect

import torch


def keeps_logits(model) -> bool:
    """Whether `model`'s forward takes `logits_to_keep` (transformers' causal LMs), looking
    through DeepSpeed's engine and DDP (`.module`) and PEFT's wrapper (`get_base_model()`)."""
    while True:
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            break
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def logits_from(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, first: int,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """The logits of columns `first`..L-1 at least, and the column of the returned [:, 0]:
    (B, L - first, V) and `first` when the model can skip the others, else (B, L, V) and 0
    (the same values either way). `position_ids` for left-padded rows, as `generate` numbers them."""
    extra = {"position_ids": position_ids} if position_ids is not None else {}
    if keeps_logits(model):
        keep = input_ids.shape[1] - first
        return model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep, **extra).logits, first
    return model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits, 0
