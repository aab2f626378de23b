"""The canary's sequential comparison: the confidence sequence against its closed form, its
calls, and its error rates on simulated rating streams looked at after every 50 ratings."""
from __future__ import annotations

import math
import random

import pytest

from rlhf_core.eval.always_valid import Arm, decide, half_width, likelihood_ratio


@pytest.mark.parametrize("v,tau,alpha", [(1e-4, 0.05, 0.05), (4e-3, 0.02, 0.01), (2.5e-5, 0.1, 0.1)])
def test_the_sequence_ends_where_the_mixture_likelihood_ratio_reaches_one_over_alpha(v, tau, alpha):
    d, w = 0.013, half_width(v, alpha, tau)
    assert likelihood_ratio(d, v, d, tau) == pytest.approx(math.sqrt(v / (v + tau * tau)))  # at the estimate: < 1
    for edge in (d - w, d + w):
        assert likelihood_ratio(d, v, edge, tau) == pytest.approx(1 / alpha)
    assert likelihood_ratio(d, v, d + 1.01 * w, tau) > 1 / alpha > likelihood_ratio(d, v, d + 0.99 * w, tau)


def test_the_calls_promote_roll_back_continue_and_stop_at_the_budget():
    champion = Arm(up=6000, n=10_000)
    assert decide(champion, Arm(6100, 10_000), margin=0.05).action == "promote"
    worse = decide(champion, Arm(4500, 10_000), margin=0.05)
    assert worse.action == "roll_back" and "worse than the margin -0.05" in worse.reason
    assert decide(Arm(50, 80), Arm(60, 80), margin=0.05).action == "continue"  # too few ratings yet
    near = decide(Arm(600, 1000), Arm(555, 1000), margin=0.05)
    assert near.action == "continue" and near.low < -0.05 < near.high
    stopped = decide(Arm(600, 1000), Arm(555, 1000), margin=0.05, max_ratings=2000)
    assert stopped.action == "roll_back" and "still open at 2000 ratings, the champion stays" in stopped.reason


def run_canary(rng: random.Random, champion_rate: float, canary_rate: float, margin: float, every: int = 50,
               max_ratings: int = 8000) -> str:
    up = [0, 0]
    for n in range(1, max_ratings + 1):
        arm = n % 2  # half the users each way
        up[arm] += rng.random() < (canary_rate if arm else champion_rate)
        if n % every == 0:
            call = decide(Arm(up[0], n - n // 2), Arm(up[1], n // 2), margin=margin, max_ratings=max_ratings)
            if call.action != "continue":
                return call.action
    raise AssertionError("no call at the budget")


def test_equal_versions_are_rarely_rolled_back_and_one_at_the_margin_rarely_promoted():
    rng = random.Random(0)
    equal = [run_canary(rng, 0.6, 0.6, margin=0.05) for _ in range(200)]
    at_margin = [run_canary(rng, 0.6, 0.55, margin=0.05) for _ in range(200)]
    # alpha 0.05 over every look: about 2.5% each way; 200 canaries leave room for their noise
    assert equal.count("roll_back") / 200 <= 0.05
    assert at_margin.count("promote") / 200 <= 0.05
    assert equal.count("promote") > 150  # and the test does decide
