"""Paired bootstrap intervals against a loop reference and closed forms, and the gates that
decide on them: a candidate equal to the champion is undecided, a clearly better one passes,
a clearly worse one is rejected."""
import math
import random
import re
from dataclasses import replace

import numpy as np
import pytest

from rlhf_core.config import GateConfig
from rlhf_core.eval.confidence import (
    Interval,
    bootstrap_interval,
    differences,
    prompts_to_decide,
    proxy_audit_gaps,
    win_outcomes,
)
from rlhf_core.eval.gates import EvalFigures, gate
from rlhf_core.eval.metrics import win_rate


def loop_bootstrap(outcomes, level, samples, seed):
    """The same resamples, one prompt at a time."""
    rng = np.random.default_rng(seed)
    n, means = len(outcomes), []
    for start in range(0, samples, 256):
        block = rng.integers(0, n, size=(min(256, samples - start), n))
        for row in block:
            means.append(sum(outcomes[int(i)] for i in row) / n)
    means.sort()
    tail = (1 - level) / 2

    def quantile(q):  # numpy's default: linear between the closest ranks
        pos = q * (len(means) - 1)
        lo = math.floor(pos)
        return means[lo] + (pos - lo) * (means[min(lo + 1, len(means) - 1)] - means[lo])

    return quantile(tail), quantile(1 - tail)


def test_the_interval_matches_a_loop_over_the_same_resamples():
    outcomes = [random.Random(3).choice([0.0, 0.5, 1.0]) for _ in range(57)]
    got = bootstrap_interval(outcomes, 0.9, 600, seed=5)
    low, high = loop_bootstrap(outcomes, 0.9, 600, 5)
    assert got.low == pytest.approx(low, abs=1e-12) and got.high == pytest.approx(high, abs=1e-12)
    assert got.estimate == pytest.approx(sum(outcomes) / 57) and got.n == 57 and got.level == 0.9


def loop_paired_gap_bootstrap(proxy_wins, audit_wins, level, samples, seed):
    """The same resamples; per resample the proxy's win rate minus the audit's over the same prompts."""
    rng = np.random.default_rng(seed)
    n, gaps = len(proxy_wins), []
    for start in range(0, samples, 256):
        for row in rng.integers(0, n, size=(min(256, samples - start), n)):
            gaps.append(sum(proxy_wins[int(i)] for i in row) / n - sum(audit_wins[int(i)] for i in row) / n)
    low, high = np.quantile(gaps, [(1 - level) / 2, 1 - (1 - level) / 2])
    return low, high


def audit_and_proxy_scores(n=61, seed=4):
    """Per prompt the candidate's and the reference's scores under the proxy and the audit; the
    audit agrees with the proxy on most prompts, as a reward model of the same task does."""
    rng = random.Random(seed)
    cand, ref = [rng.choice([0.0, 0.5, 1.0]) for _ in range(n)], [rng.choice([0.0, 0.5, 1.0]) for _ in range(n)]
    audit_cand = [c - 1.0 if rng.random() < 0.2 else c for c in cand]
    return cand, ref, audit_cand, list(ref)


def test_the_audit_win_rate_interval_matches_a_loop_over_the_same_resamples():
    _, _, audit_cand, audit_ref = audit_and_proxy_scores()
    outcomes = [(c > r) + 0.5 * (c == r) for c, r in zip(audit_cand, audit_ref)]
    got = bootstrap_interval(win_outcomes(audit_cand, audit_ref), 0.95, 700, seed=7)
    low, high = loop_bootstrap(outcomes, 0.95, 700, 7)
    assert got.low == pytest.approx(low, abs=1e-12) and got.high == pytest.approx(high, abs=1e-12)
    assert got.estimate == pytest.approx(win_rate(audit_cand, audit_ref))


def test_the_gap_interval_resamples_each_prompts_proxy_and_audit_outcomes_together():
    """A loop that draws one prompt resample and takes both win rates on it: the interval of the
    per-prompt gaps is that of the difference of the paired win rates."""
    cand, ref, audit_cand, audit_ref = audit_and_proxy_scores()
    proxy_wins = [(c > r) + 0.5 * (c == r) for c, r in zip(cand, ref)]
    audit_wins = [(c > r) + 0.5 * (c == r) for c, r in zip(audit_cand, audit_ref)]
    got = bootstrap_interval(proxy_audit_gaps(win_outcomes(cand, ref), win_outcomes(audit_cand, audit_ref)),
                             0.9, 900, seed=11)
    low, high = loop_paired_gap_bootstrap(proxy_wins, audit_wins, 0.9, 900, 11)
    assert got.low == pytest.approx(low, abs=1e-12) and got.high == pytest.approx(high, abs=1e-12)
    assert got.estimate == pytest.approx(win_rate(cand, ref) - win_rate(audit_cand, audit_ref))
    assert 0 < got.low  # the audit prefers the candidate on fewer prompts, never on more
    with pytest.raises(ValueError, match="3 proxy outcomes for 2 audit outcomes"):
        proxy_audit_gaps([1, 0, 1], [1, 0])


def test_pairing_narrows_the_gap_interval_when_the_two_models_mostly_agree():
    """Resampling the two win outcomes independently ignores that they move together: its
    interval of the gap is much wider than the paired one."""
    cand, ref, audit_cand, audit_ref = audit_and_proxy_scores(n=200)
    proxy_wins, audit_wins = win_outcomes(cand, ref), win_outcomes(audit_cand, audit_ref)
    paired = bootstrap_interval(proxy_audit_gaps(proxy_wins, audit_wins), 0.95, 2000, seed=0)
    rng = np.random.default_rng(0)
    unpaired = [proxy_wins[rng.integers(0, 200, 200)].mean() - audit_wins[rng.integers(0, 200, 200)].mean()
                for _ in range(2000)]
    unpaired_half_width = float(np.diff(np.quantile(unpaired, [0.025, 0.975]))[0]) / 2
    assert paired.half_width < 0.6 * unpaired_half_width


def test_win_outcomes_average_to_the_win_rate_and_differences_to_the_accuracy_gain():
    rng = random.Random(0)
    c, b = [rng.choice([0.1, 0.2, 0.3]) for _ in range(40)], [rng.choice([0.1, 0.2, 0.3]) for _ in range(40)]
    assert win_outcomes(c, b).mean() == pytest.approx(win_rate(c, b))
    cc, bc = [rng.random() < 0.7 for _ in range(40)], [rng.random() < 0.4 for _ in range(40)]
    assert differences(cc, bc).mean() == pytest.approx(sum(cc) / 40 - sum(bc) / 40)
    with pytest.raises(ValueError, match="3 candidate scores for 2"):
        win_outcomes([1, 2, 3], [1, 2])


def test_the_width_follows_the_normal_approximation_for_a_share():
    """A share p over N prompts: the 95% interval is close to p +- 1.96 sqrt(p (1 - p) / N)."""
    n, p = 400, 0.3
    outcomes = [1.0] * int(n * p) + [0.0] * int(n * (1 - p))
    got = bootstrap_interval(outcomes, 0.95, 4000, seed=1)
    expected = 1.96 * math.sqrt(p * (1 - p) / n)
    assert got.half_width == pytest.approx(expected, rel=0.1)
    assert got.low < p < got.high


def test_identical_answers_give_a_point_interval_and_no_number_of_prompts_decides_it():
    same = win_outcomes([0.3] * 50, [0.3] * 50)
    interval = bootstrap_interval(same, 0.95, 500)
    assert (interval.estimate, interval.low, interval.high) == (0.5, 0.5, 0.5)
    assert prompts_to_decide(interval, 0.5) is None


def test_prompts_to_decide_scale_with_the_square_of_the_width_over_the_gap():
    interval = Interval(estimate=0.55, low=0.48, high=0.62, level=0.95, n=200)
    assert prompts_to_decide(interval, 0.5) == 392  # 200 * (0.07 / 0.05) ** 2
    assert prompts_to_decide(replace(interval, low=0.54, high=0.56), 0.5) == 201  # decided already: at least one more


# --- the gates on intervals -------------------------------------------------------------

T = GateConfig(min_accuracy_gain=0.0, max_regression_vs_champion=0.02, min_win_rate_vs_reference=0.5,
               min_win_rate_vs_champion=0.5, win_rate_margin_vs_champion=0.05, max_length_ratio=2.0)
N = 200


def figures(correct, scores, ref_correct, ref_scores, champ_correct, champ_scores, seed=0) -> EvalFigures:
    def ci(x):
        return bootstrap_interval(x, 0.95, 2000, seed=seed)

    return EvalFigures(
        accuracy=float(np.mean(correct)), rm_score_mean=float(np.mean(scores)),
        win_rate_vs_reference=win_rate(scores, ref_scores), win_rate_vs_champion=win_rate(scores, champ_scores),
        kl_to_reference=1.0, mean_length=3.0, reference_mean_length=3.0, degenerate_rate=0.0, generation_failures=0.0,
        accuracy_gain_vs_reference=ci(differences(correct, ref_correct)),
        accuracy_gain_vs_champion=ci(differences(correct, champ_correct)),
        win_rate_vs_reference_interval=ci(win_outcomes(scores, ref_scores)),
        win_rate_vs_champion_interval=ci(win_outcomes(scores, champ_scores)),
    )


def policy(rng, accuracy, difficulty):
    """Per prompt: correct or not, and a reward-model score that favours correct answers.
    Prompts have a difficulty shared by every policy (`difficulty`, uniform in [0, 1]), so
    that two policies of equal accuracy solve mostly the same prompts, as on a real eval set."""
    correct = [d + rng.gauss(0, 0.1) < accuracy for d in difficulty]
    return correct, [float(c) + rng.gauss(0, 0.3) for c in correct]


REF_ACC, CHAMP_ACC = 0.35, 0.9


def reference_and_champion(rng, champion_accuracy=CHAMP_ACC):
    difficulty = [rng.random() for _ in range(N)]
    ref_c, ref_s = policy(rng, REF_ACC, difficulty)
    champ_c, champ_s = policy(rng, champion_accuracy, difficulty)
    ref = EvalFigures(accuracy=float(np.mean(ref_c)), rm_score_mean=0.0, win_rate_vs_reference=0.5,
                      win_rate_vs_champion=None, kl_to_reference=0.0, mean_length=3.0, reference_mean_length=3.0,
                      degenerate_rate=0.0, generation_failures=0.0)
    champ = replace(ref, accuracy=float(np.mean(champ_c)))
    return (ref_c, ref_s, champ_c, champ_s), ref, champ, difficulty


def equal_quality_statuses(draws: int, with_intervals: bool) -> list[str]:
    statuses = []
    for seed in range(draws):
        rng = random.Random(seed)
        (ref_c, ref_s, champ_c, champ_s), ref, champ, difficulty = reference_and_champion(rng)
        cand_c, cand_s = policy(rng, CHAMP_ACC, difficulty)
        f = figures(cand_c, cand_s, ref_c, ref_s, champ_c, champ_s, seed)
        if not with_intervals:
            f = replace(f, accuracy_gain_vs_reference=None, accuracy_gain_vs_champion=None,
                        win_rate_vs_reference_interval=None, win_rate_vs_champion_interval=None)
        statuses.append(gate(f, ref, champ, T).status)
    return statuses


def test_a_candidate_as_good_as_the_champion_is_undecided_not_a_coin_flip():
    """100 candidates of the champion's quality (other samples of the same policy quality): on
    point estimates the gate promotes about half and rejects the rest; on 95% intervals it
    leaves at least 90% undecided, and promotes or rejects at most 5% each (the one-sided
    error rate at the bar is 2.5%)."""
    point = equal_quality_statuses(100, with_intervals=False)
    assert 25 <= point.count("passed") <= 75 and point.count("undecided") == 0
    interval = equal_quality_statuses(100, with_intervals=True)
    counts = {s: interval.count(s) for s in ("passed", "rejected", "undecided")}
    assert counts["undecided"] >= 90 and counts["passed"] <= 5 and counts["rejected"] <= 5, counts
    print(f"equal quality, 100 draws: point estimates {dict((s, point.count(s)) for s in set(point))}, "
          f"intervals {counts}")


def test_an_undecided_call_says_how_many_prompts_would_decide_it():
    rng = random.Random(0)
    (ref_c, ref_s, champ_c, champ_s), ref, champ, difficulty = reference_and_champion(rng)
    cand_c, cand_s = policy(rng, CHAMP_ACC, difficulty)
    decision = gate(figures(cand_c, cand_s, ref_c, ref_s, champ_c, champ_s), ref, champ, T)
    assert decision.status == "undecided" and decision.reasons == ()
    [open_call] = [u for u in decision.undecided if u.startswith("win_rate_vs_champion")]
    assert re.search(r"about \d+ prompts would decide it", open_call) or "no number of prompts" in open_call


def test_the_same_answers_as_the_champion_are_undecided_and_say_no_prompts_decide_it():
    rng = random.Random(1)
    (ref_c, ref_s, champ_c, champ_s), ref, champ, _ = reference_and_champion(rng)
    decision = gate(figures(champ_c, champ_s, ref_c, ref_s, champ_c, champ_s), ref, champ, T)
    assert decision.status == "undecided"
    assert any("no number of prompts decides it" in u for u in decision.undecided)
    assert "undecided ⚖️" in decision.to_markdown() and "[0.5, 0.5]" in decision.to_markdown()


@pytest.mark.parametrize("seed", range(10))
def test_a_clearly_better_candidate_passes(seed):
    rng = random.Random(100 + seed)
    (ref_c, ref_s, champ_c, champ_s), ref, champ, difficulty = reference_and_champion(rng, champion_accuracy=0.6)
    cand_c, cand_s = policy(rng, 0.95, difficulty)
    decision = gate(figures(cand_c, cand_s, ref_c, ref_s, champ_c, champ_s, seed), ref, champ, T)
    assert decision.status == "passed", decision.to_markdown()


@pytest.mark.parametrize("seed", range(10))
def test_a_clearly_worse_candidate_is_rejected_as_regressed(seed):
    rng = random.Random(200 + seed)
    (ref_c, ref_s, champ_c, champ_s), ref, champ, difficulty = reference_and_champion(rng)
    cand_c, cand_s = policy(rng, 0.6, difficulty)
    decision = gate(figures(cand_c, cand_s, ref_c, ref_s, champ_c, champ_s, seed), ref, champ, T)
    assert decision.status == "rejected", decision.to_markdown()
    assert "accuracy_regressed_vs_champion" in {r.split(":")[0] for r in decision.reasons}


def test_an_estimate_within_the_margin_is_decided_by_no_number_of_prompts():
    """Win rate 0.4975 [0.4925, 0.5] against a champion: above the rejection line (0.45),
    below the bar (0.5): more prompts would only narrow the interval around it."""
    from rlhf_core.eval.gates import _better_than

    check = _better_than("win_rate_vs_champion", "too_low", Interval(0.4975, 0.4925, 0.5, 0.95, 200), 0.5, 0.45,
                         "win rate vs champion")
    assert not check.passed and check.reason is None
    assert "no number of prompts decides it: the estimate lies between 0.45 and the bar" in check.undecided
    above = _better_than("w", "too_low", Interval(0.55, 0.48, 0.62, 0.95, 200), 0.5, 0.45, "win rate")
    assert "about 392 prompts would decide it" in above.undecided
    below = _better_than("w", "too_low", Interval(0.40, 0.33, 0.47, 0.95, 200), 0.5, 0.45, "win rate")
    assert "about 392 prompts would decide it" in below.undecided  # 200 * (0.07 / 0.05)^2, toward rejection
