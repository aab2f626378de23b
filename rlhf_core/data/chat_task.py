"""A chat task for a real pretrained model: addition asked in plain English, answered in a sentence.

SmolLM2-135M-Instruct answers "What is 24 plus 38?" with "24 + 38 = 72" and "Add 32 and 26."
with "The answer is 18.": about 25-30% of its greedy answers to sums of two numbers up to 50
are right, and it often talks around the sum without giving one. The task is generated from
one seed, as the demo's is, in the formats a user's own data comes in (conversational JSONL):

- preference pairs (`prompt`, `chosen`, `rejected` as messages, `id`): the chosen answer states
  the right sum in one of several sentences; the rejected one is a realistic wrong answer, the
  kinds such a model gives: off by one or ten, the sum without its carry, an operand repeated,
  or talk about adding with no sum at all;
- a prompt set for RL and a held-out eval set (`prompt` as messages, `answer` the sum as
  digits), whose operand pairs appear in no training split.

The answer key is `answer`, judged by `last_number_match` (the last number in the response,
`data.answer_checker`); the policy never sees it: it trains on the learned reward model alone.

`python -m rlhf_core.data.chat_task OUT_DIR [--seed N]` writes the three files and prints them.
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.data.schema import write_jsonl
from rlhf_core.data.synthetic import has_carry, near_miss, sum_without_carry

QUESTIONS = (
    "What is {a} plus {b}?",
    "What is {a} + {b}?",
    "Add {a} and {b}.",
    "What do you get if you add {a} and {b}?",
    "What is the sum of {a} and {b}?",
    "Calculate {a} plus {b}.",
    "How much is {a} plus {b}?",
    "Please add {a} to {b}.",
)
ANSWERS = (
    "{a} + {b} = {s}.",
    "The answer is {s}.",
    "{a} plus {b} is {s}.",
    "The sum of {a} and {b} is {s}.",
)
NO_SUM = (  # what the base model says instead of a sum
    "To add {a} and {b}, you simply add them together.",
    "Adding {a} and {b} is a simple arithmetic operation.",
    "To find the sum, we combine {a} and {b}.",
)


@dataclass(frozen=True)
class ChatTaskFiles:
    preferences: Path
    prompts: Path
    eval: Path


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _assistant(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def wrong_answer(a: int, b: int, rng: random.Random) -> str:
    """A realistic wrong answer to a + b: a wrong sum in a sentence, or no sum at all."""
    kind = rng.random()
    if kind < 0.2:
        return rng.choice(NO_SUM).format(a=a, b=b)
    if kind < 0.45 and has_carry(a, b):
        wrong = sum_without_carry(a, b)
    elif kind < 0.55:
        wrong = rng.choice([a, b])
    else:
        wrong = near_miss(a + b, rng)
    return rng.choice(ANSWERS).format(a=a, b=b, s=wrong)


def generate_chat_task(out_dir: Path, seed: int = 0, n_pairs: int = 1200, n_prompts: int = 512, n_eval: int = 200,
                       max_operand: int = 50) -> ChatTaskFiles:
    """Write pairs.jsonl, prompts.jsonl and eval.jsonl under `out_dir` (same seed, same bytes).
    Operand pairs (a, b) are split three ways: the eval set's appear in neither training file."""
    operands = [(a, b) for a in range(1, max_operand + 1) for b in range(1, max_operand + 1)]
    rng = random.Random(seed)
    rng.shuffle(operands)
    if n_eval + n_prompts >= len(operands):
        raise ValueError(f"max_operand={max_operand} gives {len(operands)} operand pairs: too few for "
                         f"{n_eval} eval and {n_prompts} RL prompts plus pairs")
    held_out, rl, train = operands[:n_eval], operands[n_eval:n_eval + n_prompts], operands[n_eval + n_prompts:]
    pairs = []
    for i in range(n_pairs):
        a, b = train[i % len(train)]
        pairs.append({"id": f"chat-{seed}-{i}", "prompt": _user(rng.choice(QUESTIONS).format(a=a, b=b)),
                      "chosen": _assistant(rng.choice(ANSWERS).format(a=a, b=b, s=a + b)),
                      "rejected": _assistant(wrong_answer(a, b, rng))})

    def asked(ops: list[tuple[int, int]]) -> list[dict]:
        return [{"prompt": _user(rng.choice(QUESTIONS).format(a=a, b=b)), "answer": str(a + b)} for a, b in ops]

    out_dir.mkdir(parents=True, exist_ok=True)
    return ChatTaskFiles(write_jsonl(pairs, out_dir / "pairs.jsonl"), write_jsonl(asked(rl), out_dir / "prompts.jsonl"),
                         write_jsonl(asked(held_out), out_dir / "eval.jsonl"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlhf_core.data.chat_task", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    files = generate_chat_task(args.out_dir, seed=args.seed)
    for name in ("preferences", "prompts", "eval"):
        print(f"{name}: {getattr(files, name)}")


if __name__ == "__main__":
    main()
