"""Simulated users of the served demo model: they ask sums through the `openai` client and rate
the answers by the task's answer key, with label noise (people disagree and misclick).

Each user sends `requests_per_user` completions of fresh addition prompts (never one of the
held-out eval prompts, so that feedback cannot leak into the gates' test set). A share
`choice_share` of the requests ask for two answers (n=2) and the user picks one: the right
sum over a wrong one, else the one numerically closer to it, else (neither is a number) the
one with more of the sum's digits in place; a tie is not rated. The others
get a thumb: up for the right sum, down otherwise. Each label is flipped with probability
`label_noise`. `unhappy` users rate every answer down: a simple stand-in for a version users
dislike, for the satisfaction alert's tests.

They call the gateway as an application does: the API key, and each user's id signed with the
user-signing secret (`rlhf_core.serving.user_auth.sign_user`).

    python -m rlhf_core.feedback.simulated_users --base-url http://127.0.0.1:8200/v1 \
        --api-key-file runs/serving/api_key --user-secret-file runs/serving/user_signing_secret
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx

from rlhf_core.data.demo_task import addition_target
from rlhf_core.data.synthetic import prompt_for
from rlhf_core.serving.user_auth import sign_user


@dataclass(frozen=True)
class UsersConfig:
    users: int = 8
    requests_per_user: int = 12
    choice_share: float = 0.3
    label_noise: float = 0.1
    max_operand: int = 99
    max_tokens: int = 4
    temperature: float = 1.0
    unhappy: bool = False
    seed: int = 0


def closeness(answer: str, target: str) -> float:
    """Higher is better: 0 for the right sum, minus the distance for another number; below any
    number, text that is not one, ranked by how many of the sum's characters it has in place."""
    answer = answer.strip()
    try:
        return -abs(int(answer) - int(target))
    except ValueError:
        return -1e9 + sum(a == t for a, t in zip(answer, target))


def fresh_prompts(rng: random.Random, n: int, max_operand: int, exclude: set[str]) -> list[str]:
    width = len(str(max_operand))
    prompts: list[str] = []
    while len(prompts) < n:
        p = prompt_for(rng.randint(0, max_operand), rng.randint(0, max_operand), width)
        if p not in exclude:
            prompts.append(p)
    return prompts


def simulate(base_url: str, api_key: str, cfg: UsersConfig = UsersConfig(), exclude: Iterable[str] = (), *,
             user_secret: str, http_client: httpx.Client | None = None) -> dict:
    """Run the users against an OpenAI-compatible gateway with `/v1/feedback`, each request
    signed for its user with `user_secret`; returns counts of requests, thumbs up and down,
    choices, skipped ties and refused feedback. `http_client` (e.g. an in-process test client)
    carries every request instead of a new connection pool."""
    from openai import OpenAI  # noqa: PLC0415

    rng = random.Random(cfg.seed)
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=2, http_client=http_client)
    counts: Counter = Counter()
    feedback_url = base_url.rstrip("/") + "/feedback"
    with contextlib.nullcontext(http_client) if http_client is not None else httpx.Client(timeout=60) as http:
        for u in range(cfg.users):
            user = f"sim-user-{cfg.seed}-{u}"
            signed = sign_user(user_secret, user)
            for prompt in fresh_prompts(rng, cfg.requests_per_user, cfg.max_operand, set(exclude)):
                target = addition_target(prompt)
                n = 2 if rng.random() < cfg.choice_share else 1
                out = client.completions.create(model="policy", prompt=prompt, max_tokens=cfg.max_tokens,
                                                temperature=cfg.temperature, n=n, user=user,
                                                seed=rng.randrange(2**31), extra_headers=signed)
                counts["requests"] += 1
                answers = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
                body = _label(answers, target, cfg, rng)
                if body is None:
                    counts["ties_skipped"] += 1
                    continue
                r = http.post(feedback_url, json={"response_id": out.id, **body},
                              headers={"Authorization": f"Bearer {api_key}", **signed})
                if r.status_code != 200:
                    counts[f"refused_{r.status_code}"] += 1
                    continue
                counts["choices" if "preferred" in body else f"thumbs_{body['rating']}"] += 1
    return dict(counts)


def _label(answers: list[str], target: str, cfg: UsersConfig, rng: random.Random) -> dict | None:
    noisy = rng.random() < cfg.label_noise
    if len(answers) == 2:
        a, b = (closeness(x, target) for x in answers)
        if a == b:
            return None
        better = 0 if a > b else 1
        return {"preferred": (1 - better) if noisy or cfg.unhappy else better}
    good = answers[0].strip() == target and not cfg.unhappy
    return {"rating": "up" if good != noisy else "down"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="the gateway's /v1 URL")
    p.add_argument("--api-key-file", required=True, type=Path, help="the serving API key's file")
    p.add_argument("--user-secret-file", required=True, type=Path,
                   help="the gateway's user-signing secret's file (<serving state_dir>/user_signing_secret)")
    p.add_argument("--exclude", type=Path, help="a JSONL of prompts never to ask (the eval set)")
    for name, value in UsersConfig().__dict__.items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, type=type(value), default=value)
    args = p.parse_args(argv)
    exclude = ([json.loads(line)["prompt"] for line in args.exclude.read_text().splitlines() if line]
               if args.exclude else [])
    cfg = UsersConfig(**{k: getattr(args, k) for k in UsersConfig().__dict__})
    counts = simulate(args.base_url, args.api_key_file.read_text().strip(), cfg, exclude,
                      user_secret=args.user_secret_file.read_text().strip())
    print(json.dumps(counts, indent=2))


if __name__ == "__main__":
    main()
