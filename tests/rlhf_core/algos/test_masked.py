import pytest
import torch
from torch.testing import assert_close

from rlhf_core.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten

DT = torch.float64


def _ragged(B=4, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=g, dtype=DT)
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[0] = True  # at least one full row
    mask[1, 1:] = False  # a row with a single token
    return x, mask


def test_sum_and_mean_match_boolean_indexing():
    x, mask = _ragged()
    assert_close(masked_sum(x, mask), x[mask].sum())
    assert_close(masked_mean(x, mask), x[mask].mean())
    for b in range(x.shape[0]):
        assert_close(masked_mean(x, mask, dim=-1)[b], x[b][mask[b]].mean())


def test_float_mask_equals_bool_mask():
    x, mask = _ragged()
    assert_close(masked_mean(x, mask.to(DT)), masked_mean(x, mask))


def test_empty_selection_is_zero_not_nan():
    x = torch.randn(2, 3, dtype=DT)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    assert masked_mean(x, mask).item() == 0.0
    assert masked_var(x, mask).item() == 0.0


@pytest.mark.parametrize("unbiased", [True, False])
def test_var_matches_torch_var(unbiased):
    x, mask = _ragged()
    assert_close(masked_var(x, mask, unbiased=unbiased), x[mask].var(unbiased=unbiased))
    per_row = masked_var(x, mask, dim=-1, unbiased=unbiased)
    for b in (0, 2, 3):
        if mask[b].sum() > 1:
            assert_close(per_row[b], x[b][mask[b]].var(unbiased=unbiased))
    assert per_row[1].item() == 0.0  # a single token: variance 0, not NaN


def test_whiten_gives_zero_mean_unit_variance_on_valid_tokens():
    x, mask = _ragged()
    w = masked_whiten(3.0 * x + 5.0, mask)
    assert_close(w[mask].mean(), torch.tensor(0.0, dtype=DT), atol=1e-12, rtol=0)
    assert_close(w[mask].var(), torch.tensor(1.0, dtype=DT), atol=1e-6, rtol=0)
    assert (w[~mask] == 0).all()


def test_whiten_without_shift_keeps_the_mean():
    x, mask = _ragged()
    y = 3.0 * x + 5.0
    w = masked_whiten(y, mask, shift_mean=False)
    assert_close(w[mask].mean(), y[mask].mean())
    assert_close(w[mask].var(), torch.tensor(1.0, dtype=DT), atol=1e-6, rtol=0)


def test_nan_in_padding_reaches_neither_value_nor_gradient():
    x, mask = _ragged()
    x = x.masked_fill(~mask, float("nan")).requires_grad_()
    out = masked_mean(x, mask) + masked_var(x, mask) + masked_whiten(x, mask).sum()
    out.backward()
    assert torch.isfinite(out)
    assert torch.isfinite(x.grad).all()
    assert (x.grad[~mask] == 0).all()
