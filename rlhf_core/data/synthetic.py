"""The embedded demo task: small-integer addition with a verifiable answer.

Everything is generated locally from one seed (no hub), as three disjoint-by-prompt splits:

- an SFT corpus (`prompt`, `completion`) in which `wrong_share` of the completions make the
  classic schoolchild mistake of adding digit by digit without carrying. Problems with no
  carry are unaffected by that mistake, so the SFT policy learns a *systematic* error on
  carry problems: clearly imperfect, and with the right answer still likely enough under
  sampling that RL against a reward model has something real to find;
- preference pairs (`prompt`, `chosen`, `rejected`, `id`, `source`) that always prefer the
  correct sum. Like labels collected on the SFT policy's own outputs, they mostly contrast
  the right sum with the no-carry answer on carry problems; a `near_miss_share` of them
  reject, on a problem without carries, an answer off by 1 or 10 or, as often as not, one
  with a carry where nothing carries into its leading digit (`36+53=` -> `189`);
- a held-out eval set (`prompt`, `answer`) whose prompts appear in no training split; after
  its `n_eval` rows, `n_eval_reserve` more from problems no split uses, the rows the gates
  look at when a call on the first ones is undecided.

Beside them, `no_carry_suite` draws a regression suite for the gates: additions without a
carry, which the SFT corpus teaches right (`gates.regression_suites`, path `demo:no_carry`).

Same seed and config, same bytes (tested).
"""
from __future__ import annotations

import random
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.config import DemoDataConfig
from rlhf_core.data.schema import write_jsonl


def prompt_for(a: int, b: int, width: int) -> str:
    """Fixed-width operands (`07+48=`): aligned digits make the algorithm learnable by a tiny model."""
    return f"{a:0{width}d}+{b:0{width}d}="


def answer_for(total: int, width: int) -> str:
    return f"{total:0{width + 1}d}"


def sum_without_carry(a: int, b: int) -> int:
    """Digit-wise sum modulo 10, the answer of someone who forgets to carry."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def has_carry(a: int, b: int) -> bool:
    return sum_without_carry(a, b) != a + b


def near_miss(correct: int, rng: random.Random) -> int:
    """A plausible wrong answer for a problem the no-carry mistake does not affect."""
    while True:
        wrong = correct + rng.choice([-10, -1, 1, 10])
        if wrong >= 0:
            return wrong


def carried_where_none(correct: int, width: int, rng: random.Random) -> int:
    """A wrong answer to a problem without a carry: half the time a carry into the answer's
    leading digit where nothing carries (`36+53=` -> `189`: what a policy that learned to carry
    overdoes, and a reward model that only ever saw a leading 1 on right answers would reward),
    else a `near_miss`."""
    return correct + 10 ** width if rng.random() < 0.5 else near_miss(correct, rng)


@dataclass(frozen=True)
class DemoFiles:
    sft: Path
    preferences: Path
    eval: Path


def generate_demo_data(cfg: DemoDataConfig, out_dir: Path) -> DemoFiles:
    """Write the three demo splits as JSONL under `out_dir` and return their paths."""
    rng = random.Random(cfg.seed)
    n, width = cfg.max_operand + 1, len(str(cfg.max_operand))
    problems = [(a, b) for a in range(n) for b in range(n)]
    needed = cfg.n_eval + max(cfg.n_sft, cfg.n_pairs)
    if needed > len(problems):
        raise ValueError(
            f"data.demo: n_eval + max(n_sft, n_pairs) = {needed} exceeds the "
            f"{len(problems)} distinct problems with max_operand={cfg.max_operand}"
        )
    rng.shuffle(problems)
    eval_set, train_pool = problems[: cfg.n_eval], problems[cfg.n_eval :]

    sft_rows = []
    sft_problems = rng.sample(train_pool, cfg.n_sft)
    for a, b in sft_problems:
        wrong = rng.random() < cfg.wrong_share
        answer = sum_without_carry(a, b) if wrong else a + b
        sft_rows.append({"prompt": prompt_for(a, b, width), "completion": answer_for(answer, width)})

    # Pairs mirror the failure modes: mostly carry problems answered without the carry, plus
    # `near_miss_share` problems without one whose rejected answer carries where nothing
    # carries, or is off by 1 or 10.
    carry_pool = [p for p in train_pool if has_carry(*p)]
    plain_pool = [p for p in train_pool if not has_carry(*p)]
    n_near = round(cfg.n_pairs * cfg.near_miss_share)
    if n_near > len(plain_pool) or cfg.n_pairs - n_near > len(carry_pool):
        raise ValueError(f"data.demo: cannot draw {cfg.n_pairs} pairs with near_miss_share={cfg.near_miss_share} "
                         f"from {len(carry_pool)} carry and {len(plain_pool)} no-carry problems")
    chosen_problems = rng.sample(carry_pool, cfg.n_pairs - n_near) + rng.sample(plain_pool, n_near)
    rng.shuffle(chosen_problems)
    pair_rows = []
    for i, (a, b) in enumerate(chosen_problems):
        correct = a + b
        rejected = sum_without_carry(a, b) if has_carry(a, b) else carried_where_none(correct, width, rng)
        pair_rows.append(
            {
                "id": f"pair-{i:06d}",
                "prompt": prompt_for(a, b, width),
                "chosen": answer_for(correct, width),
                "rejected": answer_for(rejected, width),
                "source": "demo-arithmetic",
            }
        )

    eval_set = eval_set + reserve_problems(train_pool, sft_problems + chosen_problems, cfg.n_eval_reserve, rng)
    eval_rows = [{"prompt": prompt_for(a, b, width), "answer": answer_for(a + b, width)} for a, b in eval_set]

    out_dir.mkdir(parents=True, exist_ok=True)
    files = DemoFiles(out_dir / "sft.jsonl", out_dir / "preferences.jsonl", out_dir / "eval.jsonl")
    write_jsonl(sft_rows, files.sft)
    write_jsonl(pair_rows, files.preferences)
    write_jsonl(eval_rows, files.eval)
    return files


def reserve_problems(pool: list[tuple[int, int]], used: list[tuple[int, int]], n: int,
                     rng: random.Random) -> list[tuple[int, int]]:
    """`n` problems of `pool` that no split uses, drawn last so that every other split is the
    same whatever `n` (`data.demo.n_eval_reserve`)."""
    if n == 0:
        return []
    taken = set(used)
    unused = [p for p in pool if p not in taken]
    if n > len(unused):
        raise ValueError(f"data.demo: n_eval_reserve = {n} exceeds the {len(unused)} problems that no split uses: "
                         "lower it, or n_sft or n_pairs, or raise max_operand")
    return rng.sample(unused, n)


NO_CARRY_SUITE_ROWS = 200


def no_carry_suite(cfg: DemoDataConfig, exclude: Collection[str] = (), n: int = NO_CARRY_SUITE_ROWS) -> list[dict]:
    """The demo's regression suite: `n` additions without a carry (`prompt`, `answer`), drawn
    with a seed of their own from `cfg.seed`, none of whose prompts is in `exclude` (the eval
    set's: the suite is judged apart from the task's own gate). Fewer when fewer exist.

    Why these: forgetting to carry changes nothing where nothing carries, so every such answer
    in the SFT corpus is right whatever `wrong_share`, and the SFT policy answers them right.
    RL then works on the carry problems (most preference pairs are about them); a policy that
    learned to carry where nothing carries gains on the task and loses on these. The same
    config and `exclude` give the same rows, and fewer rows are the first of more."""
    width = len(str(cfg.max_operand))
    excluded = set(exclude)
    pool = [(a, b) for a in range(cfg.max_operand + 1) for b in range(cfg.max_operand + 1)
            if not has_carry(a, b) and prompt_for(a, b, width) not in excluded]
    if not pool:
        raise ValueError(f"data.demo: no addition without a carry up to max_operand={cfg.max_operand} is left "
                         "for the regression suite")
    random.Random(f"no-carry-suite:{cfg.seed}").shuffle(pool)  # one order: n rows are a prefix of more
    chosen = pool[:n]
    return [{"prompt": prompt_for(a, b, width), "answer": answer_for(a + b, width)} for a, b in chosen]


DEMO_SUITES = {"no_carry": no_carry_suite}  # `gates.regression_suites[].path: demo:<name>`
