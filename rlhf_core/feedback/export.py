"""From feedback on served answers to a preference dataset: what to keep, what to pair, what to drop.

`build_dataset` is pure: the ratings and choices of one export window in, the dataset and a
report of what was dropped and why out. The rules, in order:

1. feedback on answers of a version since rolled back is dropped (`rolled_back_version`):
   that version was pulled for a reason, and its users' reactions describe a model nobody
   should learn from or towards;
2. a user whose feedback is more than `max_user_share` of the window's (and more than
   `min_user_flood` items) is dropped whole (`flood_user`): one rater must not steer a model;
3. the same answer to the same prompt rated both up and down is dropped (`contradictory`),
   and so are opposite choices between the same two answers;
4. pairs: a choice between the answers of one response gives (preferred, each other answer);
   answers to the same prompt rated up and down give (up, down) pairs, at most
   `max_pairs_per_prompt` per prompt; two identical texts never make a pair (`identical_answers`);
5. every kept thumb is also an unpaired example (`prompt`, `completion`, `label`, and `score`
   when one was given), the format of TRL's unpaired preference data, for methods that learn
   from single ratings. A score without a thumb has no label and is not exported
   (`score_only`); it stays in the store.

Rows keep the format the answer was served in: a completion's prompt and answers are text
(the standard format), a chat's prompt is its messages and its answers assistant turns (the
conversational format). Each row carries `response_id`, `model_version` and `source`
(`choice` or `ratings`) as lineage; the pipeline reads only the columns it knows.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import product
from typing import Any


@dataclass
class FeedbackDataset:
    pairs: list[dict[str, Any]]
    ratings: list[dict[str, Any]]
    dropped: dict[str, int] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)  # served version -> feedback items kept
    users: int = 0
    flood_users: list[str] = field(default_factory=list)

    def fingerprint(self) -> str:
        """SHA-256 of the rows, canonical JSON: the same feedback gives the same fingerprint."""
        h = hashlib.sha256()
        for row in self.pairs + self.ratings:
            h.update(json.dumps(row, sort_keys=True).encode())
        return h.hexdigest()


def _key(prompt: Any) -> str:
    return json.dumps(prompt, sort_keys=True)


def _as_answer(text: str, kind: str) -> Any:
    return [{"role": "assistant", "content": text}] if kind == "chat" else text


def _drop(items: list[dict], keep, reason: str, dropped: Counter) -> list[dict]:
    kept = [x for x in items if keep(x)]
    if len(kept) < len(items):
        dropped[reason] += len(items) - len(kept)
    return kept


def build_dataset(ratings: list[dict], choices: list[dict], *, rolled_back: set[str] = frozenset(),
                  max_user_share: float = 0.2, min_user_flood: int = 20,
                  max_pairs_per_prompt: int = 4) -> FeedbackDataset:
    """The preference dataset of one export window (rows as `FeedbackStore.feedback_between`
    returns them)."""
    dropped: Counter = Counter()
    ratings = _drop(ratings, lambda r: r["model_version"] not in rolled_back, "rolled_back_version", dropped)
    choices = _drop(choices, lambda c: c["model_version"] not in rolled_back, "rolled_back_version", dropped)

    per_user = Counter(x["user_hash"] for x in ratings + choices)
    total = sum(per_user.values())
    flood = sorted(u for u, n in per_user.items() if n > min_user_flood and n > max_user_share * total)
    ratings = _drop(ratings, lambda r: r["user_hash"] not in flood, "flood_user", dropped)
    choices = _drop(choices, lambda c: c["user_hash"] not in flood, "flood_user", dropped)

    thumbs = [r for r in ratings if r["thumb"] is not None]
    verdicts: dict[tuple[str, str], set[int]] = defaultdict(set)
    for r in thumbs:
        verdicts[(_key(r["prompt"]), r["text"])].add(r["thumb"])
    thumbs = _drop(thumbs, lambda r: len(verdicts[(_key(r["prompt"]), r["text"])]) == 1, "contradictory", dropped)
    preferred: dict[tuple[str, frozenset], set[str]] = defaultdict(set)
    for c in choices:
        preferred[(_key(c["prompt"]), frozenset(c["answers"]))].add(c["answers"][c["preferred_index"]])
    choices = _drop(choices, lambda c: len(preferred[(_key(c["prompt"]), frozenset(c["answers"]))]) == 1,
                    "contradictory", dropped)

    pairs: list[dict[str, Any]] = []
    for c in choices:
        best = c["answers"][c["preferred_index"]]
        others = [a for i, a in enumerate(c["answers"]) if i != c["preferred_index"]]
        for other in others:
            if other == best:
                dropped["identical_answers"] += 1
                continue
            pairs.append({"prompt": c["prompt"], "chosen": _as_answer(best, c["kind"]),
                          "rejected": _as_answer(other, c["kind"]), "source": "choice",
                          "response_id": c["response_id"], "model_version": c["model_version"]})

    by_prompt: dict[str, dict[int, dict[str, dict]]] = defaultdict(lambda: {1: {}, -1: {}})
    for r in thumbs:
        by_prompt[_key(r["prompt"])][r["thumb"]].setdefault(r["text"], r)  # one row per distinct answer
    for groups in by_prompt.values():
        made = 0
        for up, down in product(groups[1].values(), groups[-1].values()):
            if made == max_pairs_per_prompt:
                break
            pairs.append({"prompt": up["prompt"], "chosen": _as_answer(up["text"], up["kind"]),
                          "rejected": _as_answer(down["text"], down["kind"]), "source": "ratings",
                          "response_id": up["response_id"], "model_version": up["model_version"]})
            made += 1

    unpaired = [{"prompt": r["prompt"], "completion": _as_answer(r["text"], r["kind"]), "label": r["thumb"] > 0,
                 "score": r["score"], "response_id": r["response_id"], "model_version": r["model_version"]}
                for r in thumbs]
    if score_only := sum(r["thumb"] is None for r in ratings):
        dropped["score_only"] = score_only  # kept in the store; a score without a thumb has no label
    versions = Counter(x["model_version"] for x in thumbs + choices)
    return FeedbackDataset(pairs, unpaired, dict(dropped), dict(sorted(versions.items())),
                           users=len({x["user_hash"] for x in thumbs + choices}), flood_users=flood)


def text_view(row: dict[str, Any]) -> dict[str, str]:
    """A pair as plain text for the data contract: a conversation's turns joined by newlines."""
    def text(value: Any) -> str:
        return value if isinstance(value, str) else "\n".join(m["content"] for m in value)

    return {"prompt": text(row["prompt"]), "chosen": text(row["chosen"]), "rejected": text(row["rejected"])}
