"""Masked reductions: the primitives every estimator and loss in `rlhf_core.algos` uses.

Masks are 0/1 (bool or any numeric dtype) and broadcastable to `x`. Masked positions are
selected away with `torch.where` before any arithmetic, never multiplied by zero, so a NaN or
inf in padding (e.g. the log-probability of a pad token) cannot leak into a result or a
gradient.
An empty selection reduces to 0 rather than NaN.

Source: verl `verl/utils/torch_functional.py` (masked_mean / masked_var / masked_whiten).
"""
from __future__ import annotations

import torch



def _select(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`x` where `mask` is set, else 0; gradients to masked positions are exactly 0."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(
    x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, keepdim: bool = False
) -> torch.Tensor:
    """Sum of `x` over the positions where `mask` is set.

    x: any shape, e.g. (B, T); mask: broadcastable to x. dim None sums everything (0-d result).
    """
    selected = _select(x, mask)
    if dim is None:
        return selected.sum()
    return selected.sum(dim=dim, keepdim=keepdim)


def _count(x: torch.Tensor, mask: torch.Tensor, dim: int | None, keepdim: bool) -> torch.Tensor:
    """Number of selected elements, as x's dtype."""
    ones = torch.ones_like(x)
    return masked_sum(ones, mask, dim, keepdim)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, keepdim: bool = False
) -> torch.Tensor:
    """Mean of `x` over the positions where `mask` is set; 0 where nothing is selected.

    x: (B, T) typically; dim None gives the mean over all selected tokens of the batch
    (a 0-d tensor); dim=-1 gives per-sequence means (B,).
    """
    count = _count(x, mask, dim, keepdim)
    return masked_sum(x, mask, dim, keepdim) / count.clamp(min=1)


def masked_var(
    x: torch.Tensor,
    mask: torch.Tensor,
    dim: int | None = None,
    keepdim: bool = False,
    unbiased: bool = True,
) -> torch.Tensor:
    """Variance of `x` over the selected positions.

    unbiased=True applies Bessel's correction n / (n - 1) (verl's default). With a single
    selected element the (biased) variance is 0 and stays 0 instead of becoming NaN.
    """
    x = _select(x, mask)  # NaN in padding would poison the gradient of (x - mean)^2
    mean = masked_mean(x, mask, dim, keepdim=True)
    var = masked_mean((x - mean) ** 2, mask, dim, keepdim=keepdim)
    if unbiased:
        n = _count(x, mask, dim, keepdim)
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise `x` to zero mean and unit variance over all selected positions of the batch.

    x, mask: (B, T) -> (B, T). Statistics are global (not per sequence) with the unbiased
    variance, as in verl / TRL. shift_mean=False keeps the original mean (rescale only),
    as TRL does for rewards. Masked positions of the output are 0.
    """
    x = _select(x, mask)
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _select(whitened, mask)
