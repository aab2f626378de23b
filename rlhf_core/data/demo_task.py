"""The demo task's verifiable reward: exact match of the zero-padded sum. It lives with the
task's generator (`rlhf_core.data.synthetic`), whose answers it checks, and is registered
as `addition_exact_match` in `rlhf_core.training.verifiable.VERIFIABLE_REWARDS`."""
from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from rlhf_core.data.synthetic import answer_for

_ADDITION = re.compile(r"^\s*(\d+)\+(\d+)=\s*$")


def addition_target(prompt: str) -> str:
    """The demo task's answer to `a+b=`: the sum zero-padded to one more digit than the
    operands (`07+48=` -> `055`, `answer_for`). Raises ValueError for a prompt that is not a
    demo addition."""
    match = _ADDITION.match(prompt)
    if match is None:
        raise ValueError(f"not an addition prompt of the demo task: {prompt!r}")
    a, b = match.groups()
    return answer_for(int(a) + int(b), max(len(a), len(b)))


def addition_exact_match(prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
    """1.0 where the response (white space stripped) is exactly the padded sum, else 0.0. -> (B,)."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    return torch.tensor(
        [float(r.strip() == addition_target(p)) for p, r in zip(prompts, responses)], dtype=torch.float32
    )


def _user_text(prompt) -> str:
    """A prompt's text: itself, or a conversation's last user turn."""
    if isinstance(prompt, str):
        return prompt
    turns = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"] \
        if isinstance(prompt, (list, tuple)) else []
    return turns[-1] if turns and isinstance(turns[-1], str) else ""


def demo_settings_misfit(verifiable_reward: str | None, suite_paths: Sequence[str], prompts: Sequence[str],
                         where: str) -> list[str]:
    """What of the demo's own settings cannot serve a user's data: the demo's answer key
    (`policy.verifiable_reward: addition_exact_match`, which the preference rounds' simulated rater
    also labels with) and its generated suites (`demo:<name>`) check the demo's sums only. One
    line per setting, naming it, when any of `prompts` (from `where`) is not a demo addition."""
    strangers = [p for p in prompts if _ADDITION.match(_user_text(p)) is None]
    if not strangers:
        return []
    told = f"{len(strangers)} of the {len(prompts)} prompts of {where} are not the demo's additions (e.g. {strangers[0]!r})"
    out = []
    if verifiable_reward in ("addition_exact_match", "rlhf_core.data.demo_task:addition_exact_match"):
        out.append(f"policy.verifiable_reward: addition_exact_match checks the demo's sums, and {told}: set it to "
                   "null, answer_exact_match (with an answer column) or a checker of your own")
    out += [f"gates.regression_suites: {p} is the demo's arithmetic, and {told}: list suites of your own"
            for p in suite_paths if p.startswith("demo:")]
    return out
