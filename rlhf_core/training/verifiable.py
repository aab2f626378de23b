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
import re
from collections.abc import Callable, Sequence
from typing import Any

VerifiableReward = Callable[[Sequence[str], Sequence[str]], Any]

VERIFIABLE_REWARDS: dict[str, str] = {
    "addition_exact_match": "rlhf_core.data.demo_task:addition_exact_match",
    "answer_exact_match": "rlhf_core.training.verifiable:answer_exact_match",
    "last_number_match": "rlhf_core.training.verifiable:last_number_match",
    "answer_in_response": "rlhf_core.training.verifiable:answer_in_response",
    "holds_answer": "rlhf_core.eval.behaviour:holds_answer",
    "not_refused": "rlhf_core.eval.behaviour:not_refused",
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


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number written in `text` (thousands separators dropped), as written; None if none."""
    found = NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
    return found[-1] if found else None


def last_number_match(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None]) -> Any:
    """1.0 where the last number of the response is the answer's number: a sentence such as
    "12 + 34 = 46." or "The answer is 46." answers 46; "46, or maybe 47" does not. -> (B,)."""
    import torch  # noqa: PLC0415 - configs are checked where torch is not loaded

    if not len(prompts) == len(responses) == len(answers):
        raise ValueError(f"{len(prompts)} prompts, {len(responses)} responses, {len(answers)} answers")
    missing = [p for p, a in zip(prompts, answers) if a is None or last_number(a) is None]
    if missing:
        raise ValueError(f"last_number_match: {len(missing)} prompts have no numeric answer, e.g. {missing[0]!r}")
    return torch.tensor([float(_same_number(last_number(r), last_number(a))) for r, a in zip(responses, answers)],
                        dtype=torch.float32)


def answer_in_response(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None]) -> Any:
    """1.0 where the answer appears in the response as whole words, case and white space
    aside: "The capital of France is Paris." answers "Paris"; "Parisian" does not. -> (B,)."""
    import torch  # noqa: PLC0415 - configs are checked where torch is not loaded

    if not len(prompts) == len(responses) == len(answers):
        raise ValueError(f"{len(prompts)} prompts, {len(responses)} responses, {len(answers)} answers")
    missing = [p for p, a in zip(prompts, answers) if a is None or not a.strip()]
    if missing:
        raise ValueError(f"answer_in_response: {len(missing)} prompts have no answer, e.g. {missing[0]!r}")
    return torch.tensor([float(named_in(r, a)) for r, a in zip(responses, answers)], dtype=torch.float32)


def named_in(response: str, answer: str) -> bool:
    """Whether `answer` appears in `response` as whole words, case and white space aside."""
    words = r"\s+".join(re.escape(w) for w in answer.split())
    return re.search(rf"(?<!\w){words}(?!\w)", response, flags=re.IGNORECASE) is not None


def _same_number(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and float(a) == float(b)


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


def check_answers(prompts: Sequence[str], predictions: Sequence[str], answers: Sequence[str | list[str]],
                  checker: str | None = None, where: str = "data.answer_checker") -> list[bool]:
    """Per row, whether the prediction answers its prompt right: without `checker`, it equals the
    answer after stripping white space; with one (a name in `VERIFIABLE_REWARDS`, or
    module:function, scoring 0 or 1 per row), the checker says so. An answer given as a list
    holds the answers accepted: the row is right when the prediction is right for any of them."""
    if not len(prompts) == len(predictions) == len(answers):
        raise ValueError(f"{len(prompts)} prompts, {len(predictions)} predictions, {len(answers)} answers")
    if any(isinstance(a, list) for a in answers):  # one row per accepted answer, then any per row
        rows = [(i, alt) for i, a in enumerate(answers) for alt in (a if isinstance(a, list) else [a])]
        each = check_answers([prompts[i] for i, _ in rows], [predictions[i] for i, _ in rows],
                             [alt for _, alt in rows], checker, where)
        right = [False] * len(answers)
        for (i, _), ok in zip(rows, each):
            right[i] = right[i] or ok
        return right
    if checker is None:
        return [p.strip() == a.strip() for p, a in zip(predictions, answers)]
    fn = resolve_verifiable_reward(checker)
    scores = fn(prompts, predictions, answers=list(answers)) if takes_answers(fn) else fn(prompts, predictions)
    values = [float(v) for v in scores]
    if len(values) != len(predictions) or any(v not in (0.0, 1.0) for v in values):
        raise ValueError(f"{where}: checker {checker} must score each of the {len(predictions)} rows 0 or 1, "
                         f"got {values[:5]}...")
    return [v == 1.0 for v in values]

