import math

import pytest
import torch

from rlhf_core.config import RewardShapingConfig
from rlhf_core.models.reward import RewardStats, normalise
from rlhf_core.training.reward_shaping import (
    AGGREGATES, aggregate_ensemble, bounded_shaping, clip_reward, length_decorrelate, length_penalty,
    normalise_members, proxy_reward,
)
from rlhf_core.training.rewards import combine_rewards, mix_rewards

SEEDS = (0, 1, 2)
DTYPES = (torch.float32, torch.float64)


def _scores(seed: int, k: int, b: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(k, b, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)  # (K, B)


def _lengths(seed: int, b: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(1, 200, (b,), generator=g)  # (B,) token counts


def _correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    return ((x * y).mean() / (x.pow(2).mean() * y.pow(2).mean()).sqrt()).item()


# --- slow references: Python loops over members and responses, in float64 ---

def _ref_aggregate(scores: torch.Tensor, method: str, std_coef: float) -> tuple[list[float], float]:
    rows = scores.double().tolist()
    k, b = len(rows), len(rows[0])
    out, stds = [], []
    for j in range(b):
        column = [rows[i][j] for i in range(k)]
        mean = sum(column) / k
        std = math.sqrt(sum((x - mean) ** 2 for x in column) / k)
        stds.append(std)
        out.append({"mean": mean, "min": min(column), "mean_minus_std": mean - std_coef * std}[method])
    return out, sum(stds) / b


def _ref_decorrelate(r: torch.Tensor, lengths: torch.Tensor) -> list[float]:
    rs, ls = r.double().tolist(), lengths.double().tolist()
    n = len(rs)
    r_mean, l_mean = sum(rs) / n, sum(ls) / n
    cov = sum((x - r_mean) * (y - l_mean) for x, y in zip(rs, ls)) / n
    var = sum((y - l_mean) ** 2 for y in ls) / n
    return [x - cov / var * (y - l_mean) for x, y in zip(rs, ls)]


# --- aggregate_ensemble ---

@pytest.mark.parametrize("method", AGGREGATES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_aggregate_matches_a_loop_reference(seed, dtype, method):
    scores = _scores(seed, k=seed + 2, b=17, dtype=dtype)
    got, metrics = aggregate_ensemble(scores, method, std_coef=0.7)
    want, disagreement = _ref_aggregate(scores, method, 0.7)
    torch.testing.assert_close(got, torch.tensor(want, dtype=dtype))
    assert metrics["ensemble_disagreement"] == pytest.approx(disagreement, rel=1e-5)


def test_aggregate_of_two_members_in_closed_form():
    scores = torch.tensor([[1.0], [3.0]])  # mean 2, population std 1
    assert aggregate_ensemble(scores, "mean", 0.5)[0].tolist() == [2.0]
    assert aggregate_ensemble(scores, "min", 0.5)[0].tolist() == [1.0]
    value, metrics = aggregate_ensemble(scores, "mean_minus_std", 0.5)
    assert value.tolist() == [1.5]
    assert metrics == {"ensemble_disagreement": 1.0}


@pytest.mark.parametrize("method", AGGREGATES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_member_is_returned_bit_for_bit_by_every_method(method, dtype):
    member = torch.cat([_scores(0, 1, 9, dtype)[0], torch.tensor([float("inf")], dtype=dtype)])  # (B,)
    # computing mean - lambda * std would turn the inf into nan (std of [inf] is nan)
    got, metrics = aggregate_ensemble(member[None], method, std_coef=0.5)
    assert torch.equal(got, member)
    assert metrics == {"ensemble_disagreement": 0.0}


@pytest.mark.parametrize("seed", SEEDS)
def test_aggregate_invariants(seed):
    scores = _scores(seed, k=4, b=32, dtype=torch.float64)
    mean, _ = aggregate_ensemble(scores, "mean", 1.0)
    assert (aggregate_ensemble(scores, "min", 1.0)[0] <= mean).all()
    for std_coef in (0.0, 0.5, 2.0):
        assert (aggregate_ensemble(scores, "mean_minus_std", std_coef)[0] <= mean).all()
    torch.testing.assert_close(aggregate_ensemble(scores, "mean_minus_std", 0.0)[0], mean)
    # the members' order does not matter
    permuted = scores[torch.randperm(4, generator=torch.Generator().manual_seed(seed))]
    for method in AGGREGATES:
        got, metrics = aggregate_ensemble(permuted, method, 0.5)
        want, want_metrics = aggregate_ensemble(scores, method, 0.5)
        torch.testing.assert_close(got, want)
        assert metrics["ensemble_disagreement"] == pytest.approx(want_metrics["ensemble_disagreement"])


def test_aggregate_refuses_bad_input():
    with pytest.raises(ValueError, match="no members"):
        aggregate_ensemble(torch.zeros(0, 3), "mean", 1.0)
    with pytest.raises(ValueError, match=r"must be \(K, B\); got shape \(3,\)"):
        aggregate_ensemble(torch.zeros(3), "mean", 1.0)
    with pytest.raises(ValueError, match=r"must be \(K, B\); got shape \(2, 3, 1\)"):
        aggregate_ensemble(torch.zeros(2, 3, 1), "mean", 1.0)
    with pytest.raises(ValueError, match="unknown ensemble aggregate 'median'; known: mean, min, mean_minus_std"):
        aggregate_ensemble(torch.zeros(2, 3), "median", 1.0)


# --- normalise_members ---

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_normalise_members_matches_a_loop_reference(seed, dtype):
    raw = _scores(seed, k=3, b=11, dtype=dtype)
    means, stds = [0.3, -1.2, 2.0], [1.5, 0.25, 3.0]
    want = [[(x - means[k]) / stds[k] for x in row] for k, row in enumerate(raw.double().tolist())]
    torch.testing.assert_close(normalise_members(raw, means, stds), torch.tensor(want, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_one_member_normalises_exactly_as_the_reward_model(seed, dtype):
    raw = _scores(seed, k=1, b=64, dtype=dtype)
    got = normalise_members(raw, [0.37], [1.91])
    assert torch.equal(got[0], normalise(raw[0], RewardStats(0.37, 1.91)))


def test_normalise_members_refuses_mismatched_stats():
    with pytest.raises(ValueError, match="2 members but 1 means and 2 stds"):
        normalise_members(torch.zeros(2, 3), [0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="stds must be > 0"):
        normalise_members(torch.zeros(2, 3), [0.0, 0.0], [1.0, 0.0])
    with pytest.raises(ValueError, match=r"must be \(K, B\)"):
        normalise_members(torch.zeros(3), [0.0], [1.0])


# --- clip, bounded shaping, length penalty ---

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_clip_matches_a_loop_reference(seed, dtype):
    r = _scores(seed, k=1, b=50, dtype=dtype)[0]
    want = [min(max(x, -1.5), 1.5) for x in r.double().tolist()]
    torch.testing.assert_close(clip_reward(r, 1.5), torch.tensor(want, dtype=dtype))
    with pytest.raises(ValueError, match="clip bound must be > 0"):
        clip_reward(r, 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_bounded_shaping_matches_a_loop_reference(seed, dtype):
    r = _scores(seed, k=1, b=50, dtype=dtype)[0]
    want = [1 / (1 + math.exp(-(x - 0.4) / 0.8)) for x in r.double().tolist()]
    torch.testing.assert_close(bounded_shaping(r, 0.4, 0.8), torch.tensor(want, dtype=dtype))


def test_bounded_shaping_is_one_half_at_the_reference_bounded_and_flattening():
    assert bounded_shaping(torch.tensor([0.7, 0.7]), 0.7, 2.0).tolist() == [0.5, 0.5]
    r = torch.linspace(-30, 30, 601, dtype=torch.float64)
    shaped = bounded_shaping(r, 0.0, 1.0)
    assert ((shaped > 0) & (shaped < 1)).all()
    assert (shaped.diff() > 0).all()
    # PAR: the gain of pushing the proxy from +10 to +20 past the reference is tiny
    near, far = bounded_shaping(torch.tensor([0.0, 1.0, 10.0, 20.0]), 0.0, 1.0).diff()[[0, 2]]
    assert near > 0.2 and far < 1e-4
    with pytest.raises(ValueError, match="scale must be > 0"):
        bounded_shaping(r, 0.0, 0.0)


def test_length_penalty_by_hand():
    r = torch.tensor([1.0, 1.0, 1.0, 2.0])
    lengths = torch.tensor([5, 10, 14, 30])
    # beyond the reference length of 10: 0, 0, 4 and 20 tokens, at 0.25 each
    assert length_penalty(r, lengths, 10.0, 0.25).tolist() == [1.0, 1.0, 0.0, -3.0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_length_penalty_matches_a_loop_reference(seed, dtype):
    r, lengths = _scores(seed, k=1, b=40, dtype=dtype)[0], _lengths(seed, 40)
    want = [x - 0.01 * max(n - 80.5, 0.0) for x, n in zip(r.double().tolist(), lengths.tolist())]
    torch.testing.assert_close(length_penalty(r, lengths, 80.5, 0.01), torch.tensor(want, dtype=dtype))
    with pytest.raises(ValueError, match=r"must both be \(B,\); got \(40,\) and \(39,\)"):
        length_penalty(r, lengths[:-1], 80.5, 0.01)


# --- length_decorrelate ---

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_length_decorrelate_matches_a_loop_reference(seed, dtype):
    lengths = _lengths(seed, 64)
    r = (0.02 * lengths + _scores(seed, k=1, b=64, dtype=torch.float64)[0]).to(dtype)  # longer scores higher
    assert _correlation(r, lengths) > 0.3
    got = length_decorrelate(r, lengths)
    assert got.dtype == dtype
    torch.testing.assert_close(got, torch.tensor(_ref_decorrelate(r, lengths), dtype=dtype))
    assert abs(_correlation(got, lengths)) < 1e-5
    assert got.double().mean().item() == pytest.approx(r.double().mean().item(), abs=1e-5)


def test_length_decorrelate_of_a_linear_reward_is_its_mean():
    lengths = torch.tensor([3, 10, 7, 42, 18])
    r = 2.0 * lengths.double() + 5.0
    torch.testing.assert_close(length_decorrelate(r, lengths), torch.full((5,), r.mean().item(), dtype=torch.float64))


def test_length_decorrelate_leaves_equal_lengths_alone():
    r = torch.tensor([0.3, -1.0, 2.5])
    assert torch.equal(length_decorrelate(r, torch.tensor([12, 12, 12])), r)
    with pytest.raises(ValueError, match=r"must both be \(B,\)"):
        length_decorrelate(r, torch.tensor([[12, 12, 12]]))


# --- proxy_reward ---

def test_proxy_reward_applies_every_step_in_order():
    raw = torch.tensor([[4.0, 0.0], [5.0, 1.0]], dtype=torch.float64)
    # normalised [[4, 0], [2, 0]] -> mean [3, 0] -> clip [2, 0] -> sigmoid [s(2), 0.5] -> length [s(2) - 0.2, 0.5]
    cfg = RewardShapingConfig(clip=2.0, bounded=True, length_penalty=0.1)
    got, metrics = proxy_reward(raw, [0.0, 1.0], [1.0, 2.0], torch.tensor([12, 5]), cfg,
                                reference_score=0.0, reference_length=10.0)
    want = [1 / (1 + math.exp(-2)) - 0.2, 0.5]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))
    assert metrics == pytest.approx(
        {"ensemble_disagreement": 0.5, "proxy_score_mean": 1.5, "shaped_reward_mean": sum(want) / 2})


@pytest.mark.parametrize("seed", SEEDS)
def test_one_member_with_default_shaping_is_todays_reward_bit_for_bit(seed):
    raw = _scores(seed, k=1, b=64, dtype=torch.float32)
    stats = RewardStats(mean=0.37, std=1.91)
    proxy, metrics = proxy_reward(raw, [stats.mean], [stats.std], _lengths(seed, 64), RewardShapingConfig(),
                                  reference_score=None, reference_length=None)
    assert torch.equal(proxy, normalise(raw[0], stats))
    assert metrics["ensemble_disagreement"] == 0.0
    assert metrics["proxy_score_mean"] == metrics["shaped_reward_mean"] == proxy.mean().item()
    verifiable = (_scores(seed + 7, k=1, b=64, dtype=torch.float32)[0] > 0).float()
    # the policy worker mixes the shaped term; the single reward model's reward was combine_rewards
    assert torch.equal(mix_rewards(proxy, verifiable, 0.7, 1.3), combine_rewards(raw[0], stats, verifiable, 0.7, 1.3))


def test_proxy_reward_does_not_depend_on_the_members_order():
    raw, lengths = _scores(3, k=3, b=20, dtype=torch.float64), _lengths(3, 20)
    means, stds = [0.1, -0.4, 1.0], [1.0, 2.0, 0.5]
    cfg = RewardShapingConfig(aggregate="mean_minus_std", std_coef=0.5, length_decorrelate=True)
    got, metrics = proxy_reward(raw, means, stds, lengths, cfg, None, None)
    order = [2, 0, 1]
    permuted, permuted_metrics = proxy_reward(raw[order], [means[i] for i in order], [stds[i] for i in order],
                                              lengths, cfg, None, None)
    torch.testing.assert_close(permuted, got)
    assert permuted_metrics == pytest.approx(metrics)


def test_proxy_reward_decorrelates_length_when_asked():
    lengths = _lengths(4, 128)
    raw = (0.03 * lengths + _scores(4, k=2, b=128, dtype=torch.float64)).float()  # (2, B), both favour length
    default, _ = proxy_reward(raw, [0.0, 0.0], [1.0, 1.0], lengths, RewardShapingConfig(), None, None)
    shaped, _ = proxy_reward(raw, [0.0, 0.0], [1.0, 1.0], lengths, RewardShapingConfig(length_decorrelate=True),
                             None, None)
    assert _correlation(default, lengths) > 0.3
    assert abs(_correlation(shaped, lengths)) < 1e-5


def test_proxy_reward_refuses_missing_references_and_mismatched_lengths():
    raw, lengths = torch.zeros(2, 3), torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="policy.shaping.bounded needs reference_score"):
        proxy_reward(raw, [0.0, 0.0], [1.0, 1.0], lengths, RewardShapingConfig(bounded=True), None, None)
    with pytest.raises(ValueError, match="policy.shaping.length_penalty > 0 needs reference_length"):
        proxy_reward(raw, [0.0, 0.0], [1.0, 1.0], lengths, RewardShapingConfig(length_penalty=0.1), 0.0, None)
    with pytest.raises(ValueError, match=r"lengths \(B,\); got \(2, 3\) and \(2,\)"):
        proxy_reward(raw, [0.0, 0.0], [1.0, 1.0], lengths[:2], RewardShapingConfig(), None, None)
