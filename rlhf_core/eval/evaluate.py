"""Held-out evaluation of a candidate policy against the reference (SFT) policy and the champion.

Produces the `EvalFigures` that `rlhf_core.eval.gates.gate` decides on. Every policy answers
the same held-out prompts; one reward model scores all answers, so win rates compare like
with like. What is measured, and how:

- Quality figures (accuracy, reward-model score, win rates, length, degenerate share) are
  on greedy answers: what a deterministic request to the served model returns.
- KL to the reference is the sequence KL at the training temperature T, the unit of
  `policy.kl_bound`: one response per prompt is sampled from the candidate at T and the
  exact per-token KL(pi_T(.|x, y<t) || ref_T(.|x, y<t)) over the whole vocabulary is summed
  along it. That is an unbiased estimate of KL(pi_T || ref_T) over sequences, with less
  variance than the k1 log-ratio of the sampled tokens alone.
- Lengths are in characters, so a champion with another tokenizer is measured alike.
- A prompt whose generation raises (a batch fails, then each prompt is retried alone) is a
  generation failure: its answer counts as empty and wrong, and it is in `failed_prompts`.
- Regression suites (`rlhf_core.eval.regression`) are answered greedily too, by every
  policy, and checked row by row with each suite's checker; a failed row counts as wrong.

A policy given `served` answers (`rlhf_core.eval.served`: the gate stage gives each one) is
answered by an engine of the kind serving runs; without, by Hugging Face `generate` in this
process. KL needs every token's distribution, which only the model gives: it is measured with
Hugging Face models either way.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from rlhf_core.eval.accuracy import greedy_completions
from rlhf_core.eval.confidence import (
    Interval, bootstrap_interval, differences, paired_score_interval, proxy_audit_gaps, win_outcomes,
)
from rlhf_core.eval.gates import Decision, EvalFigures, SuiteFigures
from rlhf_core.eval.metrics import degenerate_rate, response_length_stats, win_rate
from rlhf_core.eval.regression import RegressionSuite, correct, run_looks
from rlhf_core.eval.sampled_kl import exact_kl
from rlhf_core.eval.served import Answers, ServedAnswers, isolating_failures
from rlhf_core.eval.sequential import EvalLook, Look, eval_look, look_levels, look_sizes
from rlhf_core.models.reward import RewardStats, load_reward_model, normalise, score
from rlhf_core.training.verifiable import check_answers


@dataclass(frozen=True)
class Policy:
    """A policy to evaluate: its model and its own tokenizer, and its answers from serving's
    kind of engine (None: Hugging Face `generate` answers)."""

    name: str  # "candidate", "reference", "champion"
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerFast
    served: ServedAnswers | None = None


@dataclass(frozen=True)
class Scorer:
    """The reward model that scores every policy's answers (normalised as in training)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerFast
    stats: RewardStats
    max_length: int


def scorers_for(reward_dir, max_length: int, audit_dir=None) -> tuple[Scorer, Scorer | None]:
    """The reward model saved in `reward_dir` and the audit model saved in `audit_dir` (None:
    no audit; `rlhf_core.models.reward.current_audit_dir` says which one judges a policy)."""
    model, tokenizer, stats = load_reward_model(reward_dir)
    audit = None if audit_dir is None else Scorer(*load_reward_model(audit_dir), max_length)
    return Scorer(model, tokenizer, stats, max_length), audit


@dataclass
class PolicyReport:
    """A policy's figures (`figures`) plus what the report and the logs show besides them."""

    name: str
    figures: EvalFigures
    rm_scores: list[float] = field(repr=False)
    length: dict[str, float]
    failed_prompts: list[int]
    samples: list[tuple[str, str]] = field(repr=False)  # (prompt, answer), the first few

    def metrics(self) -> dict[str, float]:
        """Flat `eval/<policy>/<figure>` metrics; None figures are left out."""
        f = self.figures
        out = {
            "accuracy": f.accuracy, "rm_score_mean": f.rm_score_mean,
            "win_rate_vs_reference": f.win_rate_vs_reference, "win_rate_vs_champion": f.win_rate_vs_champion,
            "kl_to_reference": f.kl_to_reference, "degenerate_rate": f.degenerate_rate,
            "generation_failures": f.generation_failures, "length_ratio": f.length_ratio,
            **{f"length_{k}": v for k, v in self.length.items()},
            **{f"regression/{suite.name}/accuracy": suite.accuracy for suite in f.regression},
        }
        return {f"eval/{self.name}/{k}": float(v) for k, v in out.items() if v is not None}


@torch.no_grad()
def answer(policy: Policy, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 256) -> Answers:
    """Greedy answers, from `policy.served` where it has them; a batch that raises is retried
    prompt by prompt, and a prompt that still raises is recorded as failed with an empty answer."""
    if policy.served is not None:
        return policy.served.answer(prompts, max_new_tokens)
    return isolating_failures(
        lambda chunk: greedy_completions(policy.model, policy.tokenizer, chunk, max_new_tokens, batch_size),
        prompts, batch_size)


def look_budget(num_prompts: int, first_look: int | None, max_prompts: int | None) -> tuple[int, int]:
    """(the first look's prompts, the most any look answers) of `evaluate`'s eval prompts."""
    first = min(first_look or num_prompts, num_prompts)
    return first, max(first, min(max_prompts or first, num_prompts))


def _same_vocabulary(a: PreTrainedTokenizerFast, b: PreTrainedTokenizerFast) -> bool:
    return a.get_vocab() == b.get_vocab()


def exact_sequence_kl(
    policy: Policy, reference: Policy, prompts: Sequence[str], max_new_tokens: int, temperature: float,
    seed: int = 0, batch_size: int = 128,
) -> float:
    """Mean over prompts of sum_t KL(pi_T(.|x,y<t) || ref_T(.|x,y<t)) along y ~ pi_T (see the
    module docstring, `sampled_kl.exact_sequence_kl`). Both policies must share a tokenizer."""
    if not _same_vocabulary(policy.tokenizer, reference.tokenizer):
        raise ValueError(f"{policy.name} and {reference.name} have different vocabularies: no token-level KL")
    return exact_kl(policy.model, reference.model, policy.tokenizer, prompts, max_new_tokens, temperature, seed,
                    batch_size)


@dataclass
class EvalResult:
    candidate: PolicyReport
    reference: PolicyReport
    champion: PolicyReport | None
    num_prompts: int
    looks: tuple[EvalLook, ...] = ()  # the looks at the eval prompts (`evaluate`); none without a judge

    def metrics(self) -> dict[str, float]:
        out = {"eval/num_prompts": float(self.num_prompts)}
        for report in (self.candidate, self.reference, self.champion):
            if report is not None:
                out.update(report.metrics())
        return out


@dataclass(frozen=True)
class _Paired:
    """The per-prompt outcomes of every policy on the eval prompts, and how their paired
    intervals are drawn (None: no intervals)."""

    scores: dict[str, list[float]]
    audit_scores: dict[str, list[float]] | None
    correct: dict[str, list[bool]] | None
    reference: str
    confidence: float | None
    bootstrap_samples: int
    seed: int

    def interval(self, outcomes) -> Interval | None:
        if self.confidence is None:
            return None
        return bootstrap_interval(outcomes, self.confidence, self.bootstrap_samples, self.seed)

    def versus(self, name: str, vs: str, key: str) -> dict[str, Interval | None]:
        """`name`'s win-rate and accuracy-gain intervals against `vs`, as `EvalFigures` fields."""
        gain = None if self.correct is None else self.interval(differences(self.correct[name], self.correct[vs]))
        return {f"win_rate_vs_{key}_interval": self.interval(win_outcomes(self.scores[name], self.scores[vs])),
                f"accuracy_gain_vs_{key}": gain}

    def audit(self, name: str) -> dict[str, Interval | None]:
        """`name`'s audit win-rate and proxy-audit gap intervals against the reference."""
        if self.audit_scores is None:
            return {}
        audit_wins = win_outcomes(self.audit_scores[name], self.audit_scores[self.reference])
        proxy_wins = win_outcomes(self.scores[name], self.scores[self.reference])
        return {"audit_win_rate_vs_reference_interval": self.interval(audit_wins),
                "proxy_audit_gap_interval": self.interval(proxy_audit_gaps(proxy_wins, audit_wins))}


def suite_figures(
    candidate: Policy, reference: Policy, champion: Policy | None, suites: Sequence[RegressionSuite],
    max_new_tokens: int, confidence: float | None,
) -> dict[str, tuple[SuiteFigures, ...]]:
    """Per policy, its `SuiteFigures` on each suite: greedy answers checked row by row, and
    with `confidence` the paired score intervals (`confidence.paired_score_interval`) of its
    accuracy minus the reference's and the champion's. With intervals a suite is answered
    in looks (`rlhf_core.eval.sequential`): while the candidate's call on it is undecided and
    the suite's budget allows, every policy answers twice the rows; without, its first look's."""
    policies = [p for p in (candidate, reference, champion) if p is not None]
    out: dict[str, list[SuiteFigures]] = {p.name: [] for p in policies}
    for suite in suites:
        right: dict[str, list[bool]] = {p.name: [] for p in policies}

        def answer_to(n: int) -> None:
            start = len(right[reference.name])
            for p in policies:
                right[p.name] += correct(suite, answer(p, suite.prompts[start:n], max_new_tokens).texts, start)

        def diffs(name: str, level: float) -> tuple[Interval, Interval | None]:
            mine = right[name]
            vs_champion = None if champion is None else paired_score_interval(mine, right[champion.name], level)
            return paired_score_interval(mine, right[reference.name], level), vs_champion

        looks: tuple[Look, ...] = ()
        if confidence is None:
            answer_to(suite.first_look)
        else:
            looks = run_looks(suite.first_look, len(suite.prompts), suite.max_rows or len(suite.prompts),
                              suite.margin, confidence, answer_to, lambda level: diffs(candidate.name, level))
        for p in policies:
            vs_reference, vs_champion = (None, None) if confidence is None else diffs(p.name, looks[-1].level)
            out[p.name].append(SuiteFigures(suite.name, sum(right[p.name]) / len(right[p.name]), vs_reference,
                                            vs_champion, looks if p is candidate else ()))
    return {name: tuple(figures) for name, figures in out.items()}


def _scored(by: Scorer, prompts: Sequence[str], outputs: dict[str, Answers]) -> dict[str, list[float]]:
    """Each policy's answers scored by `by`, normalised as in training."""
    return {name: normalise(score(by.model, by.tokenizer, prompts, out.texts, by.max_length), by.stats).tolist()
            for name, out in outputs.items()}


Judge = Callable[[EvalFigures, EvalFigures, "EvalFigures | None"], Decision]


def evaluate(
    candidate: Policy,
    reference: Policy,
    champion: Policy | None,
    scorer: Scorer,
    prompts: Sequence[str],
    answers: Sequence[str] | None,
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
    n_samples: int = 3,
    audit: Scorer | None = None,
    confidence: float | None = None,
    bootstrap_samples: int = 2000,
    suites: Sequence[RegressionSuite] = (),
    checker: str | None = None,
    first_look: int | None = None,
    max_prompts: int | None = None,
    judge: Judge | None = None,
) -> EvalResult:
    """Answer `prompts` with every policy and compute each one's `EvalFigures`.

    `answers` (one per prompt) enable accuracy, judged by `checker` (`data.answer_checker`:
    None is the exact text); without them accuracy is None. The
    reference's win rate against itself is 0.5 and its KL 0 by definition. The champion's
    KL is NaN when its vocabulary differs from the reference's (it is not gated). `audit`, a
    reward model the policy never trained against, scores the same answers for the audit
    figures (`audit_score_mean`, `audit_win_rate_vs_reference`); without it they are None.
    With `confidence`, each policy's comparisons with the reference and the champion carry
    paired bootstrap intervals at that level (`rlhf_core.eval.confidence`, resampling the
    prompts `bootstrap_samples` times, seeded with `seed`), and with `audit` so do its audit
    win rate against the reference and its proxy-audit gap, on the same resamples. Every
    policy also answers each regression suite of `suites` (`EvalFigures.regression`).

    The figures are on the first `first_look` prompts (None: all). With `confidence` and a
    `judge` (the gate: figures -> `Decision`), the prompts are looked at as a regression suite
    is (`rlhf_core.eval.sequential`): while the judge leaves one of `EVAL_SET_CALLS` open and
    nothing is rejected, every policy answers twice the prompts, up to `max_prompts` (None:
    `first_look`) or the last prompt, each look's intervals at its spent level; the result's
    `looks` record them. KL to the reference is measured on the first look's prompts.
    """
    if not prompts:
        raise ValueError("no eval prompts")
    if answers is not None and len(answers) != len(prompts):
        raise ValueError(f"{len(answers)} answers for {len(prompts)} eval prompts")
    first, budget = look_budget(len(prompts), first_look, max_prompts)
    sizes = look_sizes(first, budget) if confidence is not None and judge is not None else (first,)
    levels = look_levels(sizes, confidence) if confidence is not None else (None,) * len(sizes)

    def kl_of(policy: Policy) -> float:  # NaN: another vocabulary, no token-level KL
        same = _same_vocabulary(policy.tokenizer, reference.tokenizer)
        return exact_sequence_kl(policy, reference, prompts[:first], max_new_tokens, temperature, seed) if same else math.nan

    looked = _Looked(candidate, reference, champion, prompts, answers, scorer, audit, max_new_tokens, checker,
                     regression=suite_figures(candidate, reference, champion, suites, max_new_tokens, confidence),
                     kl={candidate.name: kl_of(candidate), reference.name: 0.0,
                         **({} if champion is None else {champion.name: kl_of(champion)})},
                     bootstrap_samples=bootstrap_samples, seed=seed, n_samples=n_samples)
    looks: list[EvalLook] = []
    for n, level in zip(sizes, levels):
        looked.answer_to(n)
        result = looked.result(level, ())
        if judge is None or level is None:
            return result
        decision = judge(result.candidate.figures, result.reference.figures,
                         None if result.champion is None else result.champion.figures)
        looks.append(eval_look(decision, n, level, n == sizes[-1], max_prompts or first))
        if looks[-1].stopped:
            return looked.result(level, tuple(looks))
    raise AssertionError("the last look always stops")


@dataclass
class _Looked:
    """Every policy's answers to the eval prompts answered so far, with their scores and checks,
    and what the figures take besides them (the suites' figures, each policy's KL)."""

    candidate: Policy
    reference: Policy
    champion: Policy | None
    prompts: Sequence[str]
    answers: Sequence[str] | None
    scorer: Scorer
    audit: Scorer | None
    max_new_tokens: int
    checker: str | None
    regression: dict[str, tuple[SuiteFigures, ...]]
    kl: dict[str, float]
    bootstrap_samples: int
    seed: int
    n_samples: int
    texts: dict[str, list[str]] = field(default_factory=dict)
    failed: dict[str, list[int]] = field(default_factory=dict)
    scores: dict[str, list[float]] = field(default_factory=dict)
    audit_scores: dict[str, list[float]] = field(default_factory=dict)
    right: dict[str, list[bool]] = field(default_factory=dict)

    @property
    def policies(self) -> list[Policy]:
        return [p for p in (self.candidate, self.reference, self.champion) if p is not None]

    @property
    def rows(self) -> int:
        return len(self.texts.get(self.reference.name, ()))

    def answer_to(self, n: int) -> None:
        """Every policy answers the prompts from the last look's end to `n`; scored and checked."""
        start, new = self.rows, self.prompts[self.rows:n]
        outputs = {p.name: answer(p, new, self.max_new_tokens) for p in self.policies}
        scored = _scored(self.scorer, new, outputs)
        audited = _scored(self.audit, new, outputs) if self.audit is not None else {}
        for name, out in outputs.items():
            self.texts.setdefault(name, []).extend(out.texts)
            self.failed.setdefault(name, []).extend(start + i for i in out.failed_prompts)
            self.scores.setdefault(name, []).extend(scored[name])
            if audited:
                self.audit_scores.setdefault(name, []).extend(audited[name])
            if self.answers is not None:
                self.right.setdefault(name, []).extend(
                    check_answers(new, out.texts, self.answers[start:n], self.checker))

    def result(self, level: float | None, looks: tuple[EvalLook, ...]) -> EvalResult:
        """Every policy's figures on the prompts answered so far, intervals at `level`."""
        paired = _Paired(self.scores, self.audit_scores or None, self.right or None, self.reference.name, level,
                         self.bootstrap_samples, self.seed)
        reports = {p.name: self._report(p, paired) for p in self.policies}
        return EvalResult(reports[self.candidate.name], reports[self.reference.name],
                          None if self.champion is None else reports[self.champion.name], self.rows, looks)

    def _report(self, policy: Policy, paired: _Paired) -> PolicyReport:
        n, out, mine, ref = self.rows, self.texts[policy.name], self.scores[policy.name], self.reference.name
        audit = self.audit_scores or None
        length = response_length_stats(out)
        figures = EvalFigures(
            **paired.versus(policy.name, ref, "reference"),
            **paired.audit(policy.name),
            **({} if self.champion is None else paired.versus(policy.name, self.champion.name, "champion")),
            accuracy=sum(self.right[policy.name]) / n if self.right else None,
            rm_score_mean=sum(mine) / n,
            win_rate_vs_reference=win_rate(mine, self.scores[ref]),
            win_rate_vs_champion=None if self.champion is None else win_rate(mine, self.scores[self.champion.name]),
            kl_to_reference=self.kl[policy.name],
            mean_length=length["mean"],
            reference_mean_length=response_length_stats(self.texts[ref])["mean"],
            degenerate_rate=degenerate_rate(out),
            generation_failures=len(self.failed[policy.name]) / n,
            audit_score_mean=None if audit is None else sum(audit[policy.name]) / n,
            audit_win_rate_vs_reference=None if audit is None else win_rate(audit[policy.name], audit[ref]),
            regression=self.regression[policy.name],
        )
        samples = list(zip(self.prompts[:self.n_samples], out[:self.n_samples]))
        return PolicyReport(policy.name, figures, mine, length, self.failed[policy.name], samples)
