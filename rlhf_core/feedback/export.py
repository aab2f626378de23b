"""From feedback on served answers to a preference dataset: what to keep, what to pair, what to drop.

`build_dataset` is pure: the ratings and choices of one export window in, the dataset and a
report of what was dropped and why out. The rules, in order:

1. feedback on answers of a version since rolled back is dropped (`rolled_back_version`):
   that version was pulled for a reason, and its users' reactions describe a model nobody
   should learn from or towards;
2. one user's judgement of the same answer to the same prompt (or of the same answers) counts
   once: a repeat is dropped (`duplicate`), the first kept;
3. one user's feedback faster than `max_burst` items in `burst_window_s` seconds is a burst: what
   exceeds the rate is dropped (`burst`), whoever or whatever sent it;
4. no user's feedback is more than `max_user_share` of the window's once a user has more than
   `min_user_flood` items: their first items up to that share are kept, the rest dropped
   (`user_cap`), the user named (`capped_users`): one rater must not steer a model;
5. the same answer to the same prompt rated both up and down is dropped (`contradictory`),
   and so are opposite choices between the same two answers;
6. pairs: a choice between the answers of one response gives (preferred, each other answer);
   answers to the same prompt rated up and down give (up, down) pairs, at most
   `max_pairs_per_prompt` per prompt; two identical texts never make a pair (`identical_answers`);
7. every kept thumb is also an unpaired example (`prompt`, `completion`, `label`, and `score`
   when one was given), the format of TRL's unpaired preference data, for methods that learn
   from single ratings. A score without a thumb has no label and is not exported
   (`score_only`); it stays in the store.

What was kept is then measured (`rlhf_core.feedback.quality`: length and position bias,
agreement between users), and `report` says all of it in a few lines.

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

from rlhf_core.feedback.quality import feedback_quality, text


@dataclass
class FeedbackDataset:
    pairs: list[dict[str, Any]]
    ratings: list[dict[str, Any]]
    dropped: dict[str, int] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)  # served version -> feedback items kept
    users: int = 0
    capped_users: dict[str, int] = field(default_factory=dict)  # user -> items dropped by the cap
    quality: dict[str, Any] = field(default_factory=dict)  # `rlhf_core.feedback.quality`

    def report(self) -> list[str]:
        """What the export kept, dropped and why, and how far it can be trusted, in a few lines."""
        lines = [f"kept {len(self.pairs)} pairs and {len(self.ratings)} rated answers from {self.users} users"]
        lines += [f"dropped {n}: {reason} ({DROP_REASONS.get(reason, reason)})" for reason, n in self.dropped.items()]
        if self.capped_users:
            lines.append("capped users: " + ", ".join(f"{u} ({n} dropped)" for u, n in self.capped_users.items()))
        q = self.quality
        if q:
            lines.append(f"length: chosen answer the longer in {q['length']['chosen_longer_share']} of "
                         f"{q['length']['pairs']} pairs of unequal lengths")
            if q["length_biased_raters"]:
                lines.append("raters who chose the longest answer almost always: " + ", ".join(
                    f"{u} ({share})" for u, share in q["length_biased_raters"].items()))
            pos, agree = q["position"], q["agreement"]
            lines.append(f"position: first answer preferred in {pos['first_preferred_share']} of {pos['choices']} "
                         f"choices (chance {pos['chance_share']})")
            lines.append(f"agreement: thumbs {agree['thumbs']['agree_share']} over {agree['thumbs']['user_pairs']} "
                         f"user pairs, choices {agree['choices']['agree_share']} over {agree['choices']['user_pairs']}")
        return lines

    def fingerprint(self) -> str:
        """SHA-256 of the rows, canonical JSON: the same feedback gives the same fingerprint."""
        h = hashlib.sha256()
        for row in self.pairs + self.ratings:
            h.update(json.dumps(row, sort_keys=True).encode())
        return h.hexdigest()


DROP_REASONS = {
    "rolled_back_version": "feedback on a version since rolled back",
    "duplicate": "one user judged the same answer again",
    "burst": "faster than feedback.max_burst items in feedback.burst_window_s seconds from one user",
    "user_cap": "beyond feedback.max_user_share of the window from one user",
    "contradictory": "the same answer rated both ways, or opposite choices",
    "identical_answers": "two identical answers make no pair",
    "score_only": "a score without a thumb has no label (kept in the store)",
    "data_contract": "text the preference-data contract refuses",
}


def _key(prompt: Any) -> str:
    return json.dumps(prompt, sort_keys=True)


def _as_answer(text: str, kind: str) -> Any:
    return [{"role": "assistant", "content": text}] if kind == "chat" else text


def _drop(items: list[dict], keep, reason: str, dropped: Counter) -> list[dict]:
    kept = [x for x in items if keep(x)]
    if len(kept) < len(items):
        dropped[reason] += len(items) - len(kept)
    return kept


def _first_only(items: list[dict], judgement, dropped: Counter) -> list[dict]:
    seen: set = set()
    kept = []
    for x in items:
        key = (x["user_hash"], _key(x["prompt"]), judgement(x))
        if key in seen:
            dropped["duplicate"] += 1
        else:
            seen.add(key)
            kept.append(x)
    return kept


def _in_time_order(ratings: list[dict], choices: list[dict]) -> list[dict]:
    """Ratings and choices together, oldest first (rows without a time keep their place)."""
    return sorted(ratings + choices, key=lambda x: x.get("updated_at") or 0.0)


def _kept_of(ratings: list[dict], choices: list[dict], keep: set[int]) -> tuple[list[dict], list[dict]]:
    return [r for r in ratings if id(r) in keep], [c for c in choices if id(c) in keep]


def _without_bursts(ratings: list[dict], choices: list[dict], max_burst: int, window_s: float,
                    dropped: Counter) -> tuple[list[dict], list[dict]]:
    recent: dict[str, list[float]] = defaultdict(list)
    keep = set()
    for x in _in_time_order(ratings, choices):
        t = x.get("updated_at")
        times = recent[x["user_hash"]]
        if t is not None:
            times[:] = [s for s in times if s > t - window_s]
            if len(times) >= max_burst:
                dropped["burst"] += 1
                continue
            times.append(t)
        keep.add(id(x))
    return _kept_of(ratings, choices, keep)


def _capped(ratings: list[dict], choices: list[dict], share: float, min_items: int,
            dropped: Counter) -> tuple[list[dict], list[dict], dict[str, int]]:
    """Each user's first items up to `share` of the window (counting the others' as they are)."""
    per_user = Counter(x["user_hash"] for x in ratings + choices)
    total = sum(per_user.values())
    caps = {u: max(min_items, int(share / (1 - share) * (total - n)) if share < 1 else n)
            for u, n in per_user.items() if n > min_items and n > share * total}
    taken: Counter = Counter()
    keep = set()
    for x in _in_time_order(ratings, choices):
        user = x["user_hash"]
        taken[user] += 1
        if user not in caps or taken[user] <= caps[user]:
            keep.add(id(x))
    capped = {u: per_user[u] - caps[u] for u in sorted(caps) if per_user[u] > caps[u]}
    if capped:
        dropped["user_cap"] += sum(capped.values())
    return (*_kept_of(ratings, choices, keep), capped)


def build_dataset(ratings: list[dict], choices: list[dict], *, rolled_back: set[str] = frozenset(),
                  max_user_share: float = 0.2, min_user_flood: int = 20, max_burst: int = 20,
                  burst_window_s: float = 60.0, max_pairs_per_prompt: int = 4) -> FeedbackDataset:
    """The preference dataset of one export window (rows as `FeedbackStore.feedback_between`
    returns them)."""
    dropped: Counter = Counter()
    ratings = _drop(ratings, lambda r: r["model_version"] not in rolled_back, "rolled_back_version", dropped)
    choices = _drop(choices, lambda c: c["model_version"] not in rolled_back, "rolled_back_version", dropped)
    ratings = _first_only(ratings, lambda r: r["text"], dropped)
    choices = _first_only(choices, lambda c: frozenset(c["answers"]), dropped)
    ratings, choices = _without_bursts(ratings, choices, max_burst, burst_window_s, dropped)
    ratings, choices, capped = _capped(ratings, choices, max_user_share, min_user_flood, dropped)

    thumbs = [r for r in ratings if r["thumb"] is not None]
    judged = (thumbs, choices)  # measured before disagreements are dropped: they are what agreement counts
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
                           users=len({x["user_hash"] for x in thumbs + choices}), capped_users=capped,
                           quality=feedback_quality(pairs, judged[1], judged[0]))


def text_view(row: dict[str, Any]) -> dict[str, str]:
    """A pair as plain text for the data contract: a conversation's turns joined by newlines."""
    return {"prompt": text(row["prompt"]), "chosen": text(row["chosen"]), "rejected": text(row["rejected"])}
