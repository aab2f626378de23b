"""How far an export's feedback can be trusted, measured before it trains anything.

Ratings from people carry their habits: some prefer the longer answer whatever it says, some
pick the first answer shown, and a thumb on one prompt says little when people who rated the
same answer disagree. `feedback_quality` measures these on the feedback an export kept:

- **length**: of the pairs whose two answers differ in length, the share whose chosen answer is
  the longer one (0.5 when length does not matter); and the raters whose own choices, among
  answers of different lengths, went to the longest at least `biased_share` of the time over at
  least `min_rater_choices` choices (named: `length_biased_raters`);
- **position**: of the choices, the share that preferred the first answer shown, beside the
  share that chance gives (the mean of 1 / answers shown);
- **agreement**: on the answers that two or more users rated, the share of user pairs whose
  thumbs agree, and on the answer sets two or more users chose from, the share of user pairs
  that chose the same answer (None where nobody repeated anybody).

The figures are reported, not acted on: a rater who prefers long answers may be right.
"""
from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from itertools import combinations
from statistics import fmean
from typing import Any


def text(value: Any) -> str:
    """An answer as text: a conversation's turns joined by newlines."""
    return value if isinstance(value, str) else "\n".join(m["content"] for m in value)


def _share(flags: Sequence[bool]) -> float | None:
    return round(fmean(flags), 4) if flags else None


def _agreement(verdicts: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    """Over the items two or more users judged: the share of user pairs that judged alike."""
    alike = [a == b for by_user in verdicts.values() if len(by_user) > 1
             for a, b in combinations(by_user.values(), 2)]
    return {"items": sum(len(by_user) > 1 for by_user in verdicts.values()), "user_pairs": len(alike),
            "agree_share": _share(alike)}


def feedback_quality(pairs: Sequence[dict], choices: Sequence[dict], thumbs: Sequence[dict], *,
                     min_rater_choices: int = 10, biased_share: float = 0.9) -> dict[str, Any]:
    """The measures of the module docstring on an export's kept pairs, and on its choices and
    thumbs before disagreements between users are dropped (rows as
    `rlhf_core.feedback.export.build_dataset` handles them)."""
    longer = [len(text(p["chosen"])) > len(text(p["rejected"])) for p in pairs
              if len(text(p["chosen"])) != len(text(p["rejected"]))]
    per_rater: dict[str, list[bool]] = defaultdict(list)
    for c in choices:
        lengths = [len(a) for a in c["answers"]]
        if len(set(lengths)) > 1:
            per_rater[c["user_hash"]].append(lengths[c["preferred_index"]] == max(lengths))
    biased = {user: _share(flags) for user, flags in sorted(per_rater.items())
              if len(flags) >= min_rater_choices and fmean(flags) >= biased_share}

    rated: dict[tuple[str, str], dict[str, int]] = defaultdict(dict)
    for r in thumbs:
        rated[(json.dumps(r["prompt"], sort_keys=True), r["text"])][r["user_hash"]] = r["thumb"]
    chose: dict[tuple[str, frozenset], dict[str, str]] = defaultdict(dict)
    for c in choices:
        chose[(json.dumps(c["prompt"], sort_keys=True), frozenset(c["answers"]))][c["user_hash"]] = \
            c["answers"][c["preferred_index"]]
    return {
        "length": {"pairs": len(longer), "chosen_longer_share": _share(longer)},
        "length_biased_raters": biased,
        "position": {"choices": len(choices), "first_preferred_share": _share([c["preferred_index"] == 0 for c in choices]),
                     "chance_share": _share([1 / len(c["answers"]) for c in choices]) if choices else None},
        "agreement": {"thumbs": _agreement(rated), "choices": _agreement(chose)},
    }
