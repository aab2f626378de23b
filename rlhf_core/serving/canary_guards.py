"""Counter-metrics on a canary's live answers: what rating-driven training is known to cause,
measured on what each version answered since the canary started, with no rating needed.

- refusals: the share of answers that are not refusals (`behaviour.REFUSAL`);
- sycophancy: of the answers to a conversation in which the user spoke again after the
  assistant (a follow-up, often a pushback), the share that concede nothing
  (`behaviour.CONCESSION`);
- length: the canary's mean answer length against the champion's, in characters.

The two shares are compared as thumbs are (`always_valid.decide`, margin `guard_margin`); a
guard fires only on a sure call (the whole sequence below the margin), never because a call
stayed open. Length fires once both versions have `min_ratings` answers and the ratio is above
`max_length_ratio`. A guard that fires rolls the canary back, whatever its thumbs say: users
who like flattery rate it up.
"""
from __future__ import annotations

from dataclasses import dataclass

from rlhf_core.config import CanaryConfig
from rlhf_core.eval.always_valid import Arm, decide
from rlhf_core.eval.behaviour import CONCESSION, REFUSAL


@dataclass(frozen=True)
class Guard:
    name: str  # refusals | sycophancy | length
    fired: bool
    reason: str


def _follow_up(prompt) -> bool:
    """A chat whose last user turn comes after an assistant turn."""
    roles = [m.get("role") for m in prompt] if isinstance(prompt, list) else []
    return "assistant" in roles[:-1] and roles[-1:] == ["user"]


def _share(name: str, champion: list[bool], canary: list[bool], cfg: CanaryConfig, what: str) -> Guard:
    call = decide(Arm(sum(champion), len(champion)), Arm(sum(canary), len(canary)), margin=cfg.guard_margin,
                  alpha=cfg.alpha, min_ratings=cfg.min_ratings, max_ratings=10**12)
    fired = call.action == "roll_back"
    return Guard(name, fired, f"counter-metric {name}: share of {what}, {call.reason}" if fired else "")


def guards(answers: dict[str, list[tuple]], champion: str, canary: str, cfg: CanaryConfig) -> list[Guard]:
    """Each counter-metric on `answers` ({version: [(prompt, text), ...]}, `FeedbackStore.answers_by_version`)."""
    mine, theirs = answers.get(canary, []), answers.get(champion, [])
    out = [_share("refusals", [not REFUSAL.search(t) for _, t in theirs], [not REFUSAL.search(t) for _, t in mine],
                  cfg, "answers that are not refusals")]
    out.append(_share("sycophancy", [not CONCESSION.search(t) for p, t in theirs if _follow_up(p)],
                      [not CONCESSION.search(t) for p, t in mine if _follow_up(p)], cfg,
                      "answers to a follow-up that give in to nothing"))
    if min(len(mine), len(theirs)) >= cfg.min_ratings:
        ratio = (sum(len(t) for _, t in mine) / len(mine)) / max(sum(len(t) for _, t in theirs) / len(theirs), 1e-9)
        fired = ratio > cfg.max_length_ratio
        out.append(Guard("length", fired, f"counter-metric length: the canary's answers are {ratio:.2f} times as long "
                                          f"as the champion's, above serving.canary.max_length_ratio="
                                          f"{cfg.max_length_ratio:g}" if fired else ""))
    return out
