"""Verifiable rewards by name: fn(prompts, responses) -> (B,) float tensor, 1.0 where a
response is right. `policy.verifiable_reward` names one: a name in `VERIFIABLE_REWARDS`, or
`module:function` for a reward of one's own.

A reward that checks against the prompt set's `answer` column takes a third argument,
`answers` (the reference answer of each prompt, aligned with `prompts`); `answer_exact_match`
is the example. Every training prompt must then have an answer.

The table holds import paths, not functions: checking a config then imports neither torch nor
any task's code, and a task module may import the config without an import cycle. A task
registers its reward by adding its name here next to the others.
"""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

VerifiableReward = Callable[[Sequence[str], Sequence[str]], Any]

VERIFIABLE_REWARDS: dict[str, str] = {
    "addition_exact_match": "rlhf_core.data.demo_task:addition_exact_match",
    "answer_exact_match": "rlhf_core.training.verifiable:answer_exact_match",
}


def takes_answers(fn: Any) -> bool:
    """Whether a verifiable reward is scored against the prompt set's answers."""
    return "answers" in inspect.signature(fn).parameters


def answer_exact_match(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None]) -> Any:
    """1.0 where the response equals the prompt's answer, white space stripped. -> (B,)."""
    import torch  # noqa: PLC0415 - configs are checked where torch is not loaded

    if not len(prompts) == len(responses) == len(answers):
        raise ValueError(f"{len(prompts)} prompts, {len(responses)} responses, {len(answers)} answers")
    missing = [p for p, a in zip(prompts, answers) if a is None]
    if missing:
        raise ValueError(f"answer_exact_match: {len(missing)} prompts have no answer, e.g. {missing[0]!r}")
    return torch.tensor([float(r.strip() == a.strip()) for r, a in zip(responses, answers)], dtype=torch.float32)


def check_verifiable_reward(name: str | None) -> None:
    """Raise ValueError unless `name` can be resolved. A registered name is taken on trust
    (nothing is imported: configs are checked where torch is not loaded); a `module:function`
    is imported now, so that a typo fails before any stage starts."""
    if name is not None and name not in VERIFIABLE_REWARDS:
        resolve_verifiable_reward(name)


def resolve_verifiable_reward(name: str | None) -> VerifiableReward | None:
    """The function `name` stands for (None: no verifiable reward). Raises ValueError for an
    unknown name, or a `module:function` that does not import or is not callable."""
    if name is None:
        return None
    path = VERIFIABLE_REWARDS.get(name, name)
    module_name, sep, attr = path.partition(":")
    if not sep:
        raise ValueError(
            f"unknown verifiable reward {name!r}; registered: {', '.join(sorted(VERIFIABLE_REWARDS))} "
            "(or give module:function)"
        )
    if not module_name or not attr:
        raise ValueError(f"verifiable reward {name!r}: expected module:function")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"verifiable reward {name!r} cannot be imported: {exc}") from None
    if not callable(fn):
        raise ValueError(f"verifiable reward {name!r} is not a function")
    return fn


def score_verifiable(fn: Any, prompts: Sequence[str], responses: Sequence[str],
                     answers: dict[str, str] | None = None) -> Any:
    """`fn`'s rewards, given each prompt's answer from `answers` when it checks against them."""
    if takes_answers(fn):
        return fn(prompts, responses, answers=[(answers or {}).get(p) for p in prompts])
    return fn(prompts, responses)
