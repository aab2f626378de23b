"""A comparison of two versions' rates that may be looked at after every rating: the
always-valid confidence sequence of the normal-mixture sequential probability ratio test
(mSPRT; Johari, Koomen, Pekelis and Walsh, "Always valid inference: continuous monitoring of
A/B tests", Operations Research 70(3), 2022).

For the difference `theta` of two rates (canary minus champion), estimated by `d` with
variance `v` (each arm's p(1 - p) / n), the mixture likelihood ratio against `theta0`, the
mixing distribution N(theta0, tau^2), is

    L(theta0) = sqrt(v / (v + tau^2)) * exp(tau^2 (d - theta0)^2 / (2 v (v + tau^2)))

and {theta0 : L(theta0) < 1 / alpha} holds the true difference at every look at once with
probability at least 1 - alpha (asymptotically, with the plug-in variance). That set is
`d +- half_width(v)`. `decide` reads it against a margin, as the promotion gates read their
intervals: `promote` when the whole sequence lies above -margin (the canary is no worse than
the margin), `roll_back` when it lies below, else `continue` until `max_ratings`, where a
call still open rolls back (the champion stays). A minimum of ratings per arm guards the
normal approximation. `tau` sets where the test is most sensitive: about the difference that
matters (the margin by default).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Arm:
    """One version's ratings so far: `up` of `n` were thumbs up."""

    up: int
    n: int

    @property
    def rate(self) -> float:
        return self.up / self.n


@dataclass(frozen=True)
class Decision:
    action: str  # promote | roll_back | continue
    difference: float  # canary rate minus champion rate
    low: float
    high: float
    ratings: int  # both arms together
    reason: str


def _variance(arm: Arm) -> float:
    p = min(max(arm.rate, 0.5 / arm.n), 1 - 0.5 / arm.n)  # an arm at 0 or 1 still has a variance
    return p * (1 - p) / arm.n


def likelihood_ratio(d: float, v: float, theta0: float, tau: float) -> float:
    """The mixture likelihood ratio L(theta0) above."""
    t2 = tau * tau
    return math.sqrt(v / (v + t2)) * math.exp(t2 * (d - theta0) ** 2 / (2 * v * (v + t2)))


def half_width(v: float, alpha: float, tau: float) -> float:
    """Half the width of {theta0 : L(theta0) < 1/alpha} around the estimate."""
    t2 = tau * tau
    return math.sqrt(v * (v + t2) / t2 * (2 * math.log(1 / alpha) + math.log((v + t2) / v)))


def decide(champion: Arm, canary: Arm, *, margin: float, alpha: float = 0.05, tau: float | None = None,
           min_ratings: int = 100, max_ratings: int = 20_000) -> Decision:
    """The canary's call after these ratings (see the module's docstring). `alpha`: the sequence
    misses the true difference at some look with probability at most alpha, about half of it on
    each side, so a wrong promotion or a wrong roll-back each happens at most about alpha / 2 of
    the time however often the call is looked at (bench/canary_sequential.py measures both)."""
    n = champion.n + canary.n
    if min(champion.n, canary.n) < min_ratings:
        return Decision("continue", math.nan, -math.inf, math.inf, n,
                        f"fewer than {min_ratings} ratings of each version so far")
    d, v = canary.rate - champion.rate, _variance(canary) + _variance(champion)
    w = half_width(v, alpha, tau if tau is not None else margin)
    low, high = d - w, d + w
    said = f"canary minus champion thumbs-up rate {d:+.4f} [{low:+.4f}, {high:+.4f}] (always valid, {1 - alpha:.0%})"
    if low > -margin:
        return Decision("promote", d, low, high, n, f"{said}: no worse than the margin {-margin:+g}")
    if high < -margin:
        return Decision("roll_back", d, low, high, n, f"{said}: worse than the margin {-margin:+g}")
    if n >= max_ratings:
        return Decision("roll_back", d, low, high, n, f"{said}: still open at {max_ratings} ratings, the champion stays")
    return Decision("continue", d, low, high, n, f"{said}: neither clearly above nor below the margin {-margin:+g}")
