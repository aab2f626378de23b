"""Held-out evaluation metrics: plain functions over responses and scores, no engines.

`answer_accuracy` (verifiable accuracy) lives in `rlhf_core.eval.accuracy`; these are the
figures the promotion gates need besides it: response length, degeneration and the
pairwise win rate of two policies under one scorer.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> Sequence[int]: ...


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default `linear` method)."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (pos - lo) * (sorted_values[hi] - sorted_values[lo])


def response_length_stats(responses: Sequence[str], tokenizer: _Encoder | None = None) -> dict[str, float]:
    """Mean, median (`p50`), 90th percentile (`p90`) and `max` of the response lengths.

    Lengths are in characters, or in tokens when a tokenizer is given (encoded without
    special tokens, so `<s>` is not counted). Percentiles interpolate linearly between
    ranks, as `numpy.percentile` does by default.
    """
    if not responses:
        raise ValueError("no responses to measure")
    if tokenizer is None:
        lengths = sorted(float(len(r)) for r in responses)
    else:
        lengths = sorted(float(len(tokenizer.encode(r, add_special_tokens=False))) for r in responses)
    return {
        "mean": sum(lengths) / len(lengths),
        "p50": _quantile(lengths, 0.5),
        "p90": _quantile(lengths, 0.9),
        "max": lengths[-1],
    }


def _longest_tandem_repeat(seq: Sequence, min_unit: int, max_unit: int, min_repeats: int) -> int:
    """Elements covered by the longest run of >= `min_repeats` back-to-back copies of one unit.

    For each unit length p, a stretch where `seq[j] == seq[j + p]` for m consecutive j is
    periodic with period p over `m + p` elements, i.e. `(m + p) // p` whole copies of its
    first p elements. Returns the most elements covered by whole copies (0 if none qualifies).
    """
    best = 0
    for p in range(min_unit, min(max_unit, len(seq) // min_repeats) + 1):
        matches = 0
        for j in range(len(seq) - p + 1):
            if j < len(seq) - p and seq[j] == seq[j + p]:
                matches += 1
                continue
            copies = (matches + p) // p
            if copies >= min_repeats:
                best = max(best, copies * p)
            matches = 0
    return best


def is_degenerate(
    response: str,
    *,
    min_repeats: int = 3,
    min_coverage: float = 0.5,
    max_unit_chars: int = 32,
    max_unit_words: int = 8,
) -> bool:
    """Whether a response is empty or a loop.

    A response is degenerate when, after stripping surrounding white space, either

    * it is empty (the input was empty or white space only), or
    * it contains a tandem repeat, `min_repeats` or more back-to-back copies of one unit,
      whose whole copies cover at least `min_coverage` of the response. The unit is either
      2 to `max_unit_chars` characters (catches loops without spaces: `055055055`) or
      1 to `max_unit_words` whitespace-separated words (`the the the`, `I am. I am. I am.`);
      coverage is counted in characters or in words respectively.

    Single-character units are not counted at the character level, so short numbers such as
    `000` or `1000` are not loops; six or more identical characters in a row still are (three
    copies of a two-character unit), e.g. `1000000`: that is the price of catching loops that
    contain no spaces.
    """
    text = response.strip()
    if not text:
        return True
    words = text.split()
    chars_covered = _longest_tandem_repeat(text, 2, max_unit_chars, min_repeats)
    words_covered = _longest_tandem_repeat(words, 1, max_unit_words, min_repeats)
    return chars_covered >= min_coverage * len(text) or words_covered >= min_coverage * len(words)


def degenerate_rate(responses: Sequence[str], **kwargs) -> float:
    """Share of responses that `is_degenerate` (keyword arguments are passed on to it)."""
    if not responses:
        raise ValueError("no responses to check")
    return sum(is_degenerate(r, **kwargs) for r in responses) / len(responses)


def _floats(scores: Iterable) -> list[float]:
    return [float(s) for s in scores]  # lists, tuples and 1-D tensors alike


def win_rate(candidate_scores: Sequence[float], baseline_scores: Sequence[float]) -> float:
    """Share of paired prompts where the candidate scores higher than the baseline; ties count half.

    `candidate_scores[i]` and `baseline_scores[i]` score the two policies' responses to the
    same prompt i (e.g. with the reward model). 0.5 means no preference either way: two
    identical policies score exactly 0.5.
    """
    cand, base = _floats(candidate_scores), _floats(baseline_scores)
    if len(cand) != len(base):
        raise ValueError(f"{len(cand)} candidate scores for {len(base)} baseline scores")
    if not cand:
        raise ValueError("no scores to compare")
    if any(math.isnan(s) for s in cand + base):
        raise ValueError("scores contain NaN")
    wins = sum(c > b for c, b in zip(cand, base))
    ties = sum(c == b for c, b in zip(cand, base))
    return (wins + 0.5 * ties) / len(cand)
