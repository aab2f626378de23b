"""Held-out evaluation: the KL against a loop reference and closed forms, failure isolation,
and figures that follow from their definitions on real (tiny, untrained) models."""
from __future__ import annotations

import copy

import pytest
import torch

from rlhf_core.config import ModelConfig
from rlhf_core.eval.accuracy import greedy_completions
from rlhf_core.eval.evaluate import Policy, Scorer, answer, evaluate, exact_sequence_kl
from rlhf_core.eval.sampled_kl import _summed_token_kl
from rlhf_core.models.llama import build_policy, save_pretrained_atomic
from rlhf_core.models.reward import RewardStats, reward_model_from_base
from rlhf_core.tokenizer import train_tokenizer

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2)
PROMPTS = ["07+48=", "1+2=", "19+19=", "33+44=", "05+05=", "12+34="]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([f"{a:02d}+{b:02d}={a + b:03d}" for a in range(20) for b in range(20)], vocab_size=64)


@pytest.fixture(scope="module")
def models(tok):
    a = build_policy(TINY, tok, seed=0).eval()
    b = build_policy(TINY, tok, seed=1).eval()
    return a, b


@pytest.fixture(scope="module")
def scorer(tok, models, tmp_path_factory):
    base = save_pretrained_atomic(models[0], tok, tmp_path_factory.mktemp("rm") / "base")
    return Scorer(reward_model_from_base(base, seed=3).eval(), tok, RewardStats(0.0, 1.0), max_length=32)


@torch.no_grad()
def loop_kl(policy, reference, prompt_ids, response_ids, temperature):
    """One row, one position at a time: sum_t sum_v p(v) (log p(v) - log q(v))."""
    out = []
    for p, r in zip(prompt_ids, response_ids):
        ids = torch.tensor([p + r])
        lp = torch.log_softmax(policy(input_ids=ids).logits[0] / temperature, -1)
        lq = torch.log_softmax(reference(input_ids=ids).logits[0] / temperature, -1)
        total = 0.0
        for t in range(len(r)):
            pos = len(p) - 1 + t
            total += sum(lp[pos, v].exp().item() * (lp[pos, v] - lq[pos, v]).item() for v in range(lp.shape[-1]))
        out.append(total)
    return torch.tensor(out)


@pytest.mark.parametrize(("temperature", "rows"), [(1.0, 16), (0.7, 16), (1.0, 2), (0.7, 1)])
def test_summed_token_kl_matches_a_loop_reference(models, tok, temperature, rows):
    """Prompts of several lengths, ragged responses (padding must count 0), in chunks of `rows`
    sequences whose heads start at each chunk's shortest prompt."""
    a, b = models
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 1
    responses = [[5, 9, 2], [7], [3, 3, 3, 3, tok.eos_token_id], [8, 8], [4], [6, 5, 4, 3]]
    got = _summed_token_kl(a, b, prompts, responses, temperature, rows=rows)
    torch.testing.assert_close(got, loop_kl(a, b, prompts, responses, temperature), atol=1e-5, rtol=1e-5)
    assert (got > 0).all()


def test_kl_of_a_policy_to_itself_is_zero_and_to_another_positive(models, tok):
    a, b = models
    assert exact_sequence_kl(Policy("a", a, tok), Policy("a2", copy.deepcopy(a), tok), PROMPTS, 4, 1.0) == pytest.approx(0, abs=1e-6)
    assert exact_sequence_kl(Policy("a", a, tok), Policy("b", b, tok), PROMPTS, 4, 1.0) > 0.01


def test_sequence_kl_is_reproducible_and_needs_one_vocabulary(models, tok):
    a, b = models
    once = exact_sequence_kl(Policy("a", a, tok), Policy("b", b, tok), PROMPTS, 4, 1.0, seed=5)
    assert exact_sequence_kl(Policy("a", a, tok), Policy("b", b, tok), PROMPTS, 4, 1.0, seed=5) == once
    other = train_tokenizer(["hello world, hello there"] * 50, vocab_size=300)
    assert other.get_vocab() != tok.get_vocab()
    with pytest.raises(ValueError, match="different vocabularies"):
        exact_sequence_kl(Policy("a", a, tok), Policy("c", a, other), PROMPTS, 4, 1.0)


def test_a_prompt_that_fails_to_generate_is_counted_and_the_rest_answered(models, tok):
    a, _ = models
    bad_token = tok("19+19=")["input_ids"][2]

    def refuse(module, args, kwargs):  # a real failure inside the model's forward
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and (ids == bad_token).any() and ids.shape[1] > 1:
            raise RuntimeError("injected generation failure")

    handle = a.register_forward_pre_hook(refuse, with_kwargs=True)
    try:
        out = answer(Policy("a", a, tok), PROMPTS, max_new_tokens=3)
    finally:
        handle.remove()
    failing = [i for i, p in enumerate(PROMPTS) if bad_token in tok(p)["input_ids"]]
    assert failing and out.failed_prompts == failing
    assert all(out.texts[i] == "" for i in failing)
    expected = greedy_completions(a, tok, [p for i, p in enumerate(PROMPTS) if i not in failing], 3)
    assert [t for i, t in enumerate(out.texts) if i not in failing] == expected


def test_candidate_equal_to_reference_has_neutral_figures(models, tok, scorer):
    a, _ = models
    answers = greedy_completions(a, tok, PROMPTS, 4)
    truth = [answers[0], "nope", answers[2], "nope", "nope", "nope"]
    result = evaluate(Policy("candidate", a, tok), Policy("reference", copy.deepcopy(a), tok), None, scorer,
                      PROMPTS, truth, max_new_tokens=4, temperature=1.0)
    c = result.candidate.figures
    assert c.accuracy == pytest.approx(2 / 6) == result.reference.figures.accuracy
    assert c.win_rate_vs_reference == 0.5  # identical answers tie on every prompt
    assert c.kl_to_reference == pytest.approx(0, abs=1e-6)
    assert c.length_ratio == 1.0 and c.generation_failures == 0.0
    assert c.win_rate_vs_champion is None and result.champion is None
    metrics = result.metrics()
    assert metrics["eval/candidate/win_rate_vs_reference"] == 0.5 and "eval/candidate/win_rate_vs_champion" not in metrics


def test_win_rates_follow_the_reward_model_scores(models, tok, scorer):
    a, b = models
    result = evaluate(Policy("candidate", a, tok), Policy("reference", b, tok), Policy("champion", b, tok), scorer,
                      PROMPTS, None, max_new_tokens=4, temperature=1.0)
    cand, ref = result.candidate.rm_scores, result.reference.rm_scores
    wins = sum((c > r) + 0.5 * (c == r) for c, r in zip(cand, ref)) / len(PROMPTS)
    assert result.candidate.figures.win_rate_vs_reference == wins
    assert result.candidate.figures.win_rate_vs_champion == wins  # the champion is the reference model here
    assert result.candidate.figures.accuracy is None
    assert result.candidate.figures.rm_score_mean == pytest.approx(sum(cand) / len(cand))


def test_evaluate_rejects_mismatched_answers(models, tok, scorer):
    a, _ = models
    with pytest.raises(ValueError, match="2 answers for 6 eval prompts"):
        evaluate(Policy("candidate", a, tok), Policy("reference", a, tok), None, scorer, PROMPTS, ["1", "2"],
                 max_new_tokens=2, temperature=1.0)


def test_the_audit_figures_carry_intervals_on_the_same_resamples_as_the_proxys(models, tok, scorer, tmp_path):
    """With an audit model and `confidence`, the audit's win rate and the proxy-audit gap get
    the intervals `bootstrap_interval` gives for their per-prompt outcomes, seeded alike."""
    from rlhf_core.eval.confidence import bootstrap_interval, proxy_audit_gaps, win_outcomes
    from rlhf_core.models.reward import normalise, score

    a, b = models
    base = save_pretrained_atomic(a, tok, tmp_path / "base")
    audit = Scorer(reward_model_from_base(base, seed=11).eval(), tok, RewardStats(0.0, 1.0), max_length=32)
    result = evaluate(Policy("candidate", a, tok), Policy("reference", b, tok), None, scorer, PROMPTS, None,
                      max_new_tokens=4, temperature=1.0, audit=audit, confidence=0.9, bootstrap_samples=300, seed=5,
                      n_samples=len(PROMPTS))
    texts = {r.name: [t for _, t in r.samples] for r in (result.candidate, result.reference)}
    assert all(len(t) == len(PROMPTS) for t in texts.values())
    audit_scores = {name: normalise(score(audit.model, tok, PROMPTS, t, 32), audit.stats).tolist()
                    for name, t in texts.items()}
    audit_wins = win_outcomes(audit_scores["candidate"], audit_scores["reference"])
    proxy_wins = win_outcomes(result.candidate.rm_scores, result.reference.rm_scores)
    f = result.candidate.figures
    assert f.audit_win_rate_vs_reference_interval == bootstrap_interval(audit_wins, 0.9, 300, 5)
    assert f.proxy_audit_gap_interval == bootstrap_interval(proxy_audit_gaps(proxy_wins, audit_wins), 0.9, 300, 5)
    assert f.audit_win_rate_vs_reference_interval.estimate == pytest.approx(f.audit_win_rate_vs_reference)
    assert f.proxy_audit_gap_interval.estimate == pytest.approx(f.win_rate_vs_reference - f.audit_win_rate_vs_reference)
    no_intervals = evaluate(Policy("candidate", a, tok), Policy("reference", b, tok), None, scorer, PROMPTS, None,
                            max_new_tokens=4, temperature=1.0, audit=audit)
    assert no_intervals.candidate.figures.proxy_audit_gap_interval is None
