"""Regression suites for the gates: small eval sets of what the base model already does right.

A suite (`gates.regression_suites`) is a JSONL file of `{"prompt": ..., "answer": ...}` rows, or
`demo:<name>`, one the demo generates into the run's data directory
(`rlhf_core.data.synthetic.DEMO_SUITES`). `load_suites` reads and checks every suite before
anything trains: a missing file, or a row that is not JSON, not an object, or lacks a
non-blank text `prompt` or `answer`, fails with every problem named by file and line in one
message. An `answer` may also be a list of the answers accepted ("small", "little"): a
response right for any of them is right, and a row may have no `answer` where the suite's
checker reads none (`not_refused`, `rlhf_core.eval.behaviour`). `correct` scores a policy's answers row by row (0/1) with the suite's checker, a
verifiable reward of `rlhf_core.training.verifiable` (`answer_exact_match` compares with the
row's answer, white space stripped).

`rlhf_core.eval.evaluate` answers the suites greedily; the gate's figures and rule are
`rlhf_core.eval.gates.SuiteFigures` and the `regression_vs_*` checks.
"""
from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rlhf_core.chat import render_prompt
from rlhf_core.config import DemoDataConfig, RegressionSuiteConfig
from rlhf_core.data.schema import DataFormatError, write_jsonl
from rlhf_core.data.synthetic import DEMO_SUITES
from rlhf_core.eval.gates import EvalFigures
from rlhf_core.eval.checks import not_worse_than
from rlhf_core.eval.confidence import Interval
from rlhf_core.eval.sequential import DEMO_FIRST_ROWS, DEMO_PREFIX, Look, look_levels, look_sizes
from rlhf_core.training.verifiable import check_answers, resolve_verifiable_reward, takes_answers

SHOWN_PROBLEMS = 5  # bad rows named per suite; the message counts the rest


class SuiteFormatError(DataFormatError):
    """A regression suite that cannot be used: the message names each file and line and what is wrong."""


@dataclass(frozen=True)
class RegressionSuite:
    """A suite read and checked: its settings, and its rows as two aligned lists."""

    name: str
    path: Path
    checker: str
    margin: float
    prompts: list[str]  # conversational ones (lists of messages) until `rendered`
    answers: list[str | list[str] | None]  # a list: the answers accepted, any one is right; None: none
    first_rows: int | None = None  # rows of the first look; None: every row
    max_rows: int | None = None  # the budget asked for; more than len(prompts) when the suite has fewer rows

    @property
    def first_look(self) -> int:
        return min(self.first_rows or len(self.prompts), len(self.prompts))


def read_suite(path: str | Path, answers_needed: bool = True) -> tuple[list[str], list[str | list[str] | None]]:
    """(prompts, answers) of a suite file. Blank lines are skipped, as in every JSONL the
    pipeline reads; any other bad row raises `SuiteFormatError` naming `path:line` (up to
    `SHOWN_PROBLEMS` of them, and how many more). Without `answers_needed` a row may leave out
    its answer (None)."""
    path = Path(path)
    if not path.is_file():
        raise SuiteFormatError(f"{path}: regression suite file not found")
    prompts, answers, problems = [], [], []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
            if not raw.strip():
                continue
            row, problem = _parse_row(raw, answers_needed)
            if problem is not None:
                problems.append(f"{path}:{lineno}: {problem}")
            else:
                prompts.append(row["prompt"])
                answers.append(row["answer"])
    if problems:
        more = len(problems) - SHOWN_PROBLEMS
        shown = problems[:SHOWN_PROBLEMS] + ([f"... and {more} more bad rows"] if more > 0 else [])
        raise SuiteFormatError("\n".join(shown))
    if not prompts:
        raise SuiteFormatError(f"{path}: regression suite has no rows")
    return prompts, answers


def _parse_row(raw: bytes, answers_needed: bool) -> tuple[dict | None, str | None]:
    """(the row, None), or (None, what is wrong with it)."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not valid UTF-8"
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc.msg})"
    if not isinstance(row, dict):
        return None, f"expected a JSON object with prompt and answer, got {type(row).__name__}"
    if not answers_needed:
        row.setdefault("answer", None)
    for key in ("prompt", "answer"):
        if key not in row:
            return None, f"{key} is missing"
        if key == "answer" and row[key] is None and not answers_needed:
            continue
        if key == "prompt" and isinstance(row[key], list):
            problem = _messages_problem(row[key])
            if problem is not None:
                return None, problem
            continue
        if key == "answer" and isinstance(row[key], list):  # the answers accepted, any one is right
            if not row[key] or not all(isinstance(a, str) and a.strip() for a in row[key]):
                return None, "answer as a list must hold one or more non-blank texts"
            continue
        if not isinstance(row[key], str):
            return None, f"{key} must be text or (answer) a list of texts, got {type(row[key]).__name__}"
        if not row[key].strip():
            return None, f"{key} is empty"
    return row, None


def _messages_problem(messages: list) -> str | None:
    """What is wrong with a conversational prompt (a list of {role, content} turns), or None."""
    if not messages:
        return "prompt is an empty list of messages"
    for i, turn in enumerate(messages):
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)):
            return f"prompt message {i} must be an object with text role and content"
    if messages[-1]["role"] != "user":
        return f"prompt's last message is from {messages[-1]['role']!r}, not the user"
    return None


def needs_answers(checker: str | None) -> bool:
    """Whether a suite checked by `checker` needs an answer in every row (the exact text does)."""
    return checker is None or takes_answers(resolve_verifiable_reward(checker))


def rendered(suite: RegressionSuite, tokenizer) -> RegressionSuite:
    """`suite` with its conversational prompts rendered by `tokenizer`'s chat template, as the
    policy is asked in training and in serving (text prompts stay as they are)."""
    return replace(suite, prompts=[render_prompt(tokenizer, p) for p in suite.prompts])


def suite_file(path: str, data_dir: Path, demo: DemoDataConfig, exclude: Collection[str] = (),
               rows: int = DEMO_FIRST_ROWS) -> Path:
    """The file a suite's `path` stands for: itself, or for `demo:<name>` the demo suite's
    first `rows` rows generated from `demo` (without the prompts in `exclude`) into `data_dir`."""
    if not path.startswith(DEMO_PREFIX):
        return Path(path)
    name = path[len(DEMO_PREFIX):]
    if name not in DEMO_SUITES:
        known = ", ".join(DEMO_PREFIX + n for n in sorted(DEMO_SUITES))
        raise SuiteFormatError(f"{path}: no such demo suite; the demo's: {known}")
    return write_jsonl(DEMO_SUITES[name](demo, exclude, rows), data_dir / f"regression-{name}.jsonl")


def load_suites(suites: Sequence[RegressionSuiteConfig], data_dir: Path, demo: DemoDataConfig,
                exclude: Collection[str] = ()) -> list[RegressionSuite]:
    """Every configured suite read and checked (demo suites generated into `data_dir` first,
    without the prompts in `exclude`), kept to its budget (`max_rows`, else `rows`). Raises one
    `SuiteFormatError` that names every suite that cannot be used, by file and line."""
    loaded, problems = [], []
    for suite in suites:
        first = suite.rows or (DEMO_FIRST_ROWS if suite.path.startswith(DEMO_PREFIX) else None)
        budget = suite.max_rows or first
        try:
            path = suite_file(suite.path, data_dir, demo, exclude, budget or DEMO_FIRST_ROWS)
            prompts, answers = read_suite(path, answers_needed=needs_answers(suite.checker))
        except SuiteFormatError as exc:
            problems.append(f"regression suite {suite.name} (gates.regression_suites): {exc}")
            continue
        loaded.append(RegressionSuite(suite.name, path, suite.checker, suite.margin, prompts[:budget],
                                      answers[:budget], first, budget))
    if problems:
        raise SuiteFormatError("\n".join(problems))
    return loaded


def run_looks(first: int, available: int, budget: int, margin: float, confidence: float,
              answer_to: Callable[[int], None], intervals: Callable[[float], tuple[Interval, Interval | None]],
              ) -> tuple[Look, ...]:
    """Look at a suite until its calls are decided: `answer_to(n)` has every policy answer the
    suite's first n rows, `intervals(level)` gives the candidate's paired intervals of the
    difference (vs the reference, and vs the champion or None) on the rows answered so far.
    The looks are planned over `min(available, budget)` rows (`available`: the suite's rows);
    they stop at the first look whose calls are all decided at `-margin` (non-inferiority,
    `checks.not_worse_than`), or at the last planned one, saying which."""
    sizes = look_sizes(min(first, available, budget), min(available, budget))
    looks = []
    for n, level in zip(sizes, look_levels(sizes, confidence)):
        answer_to(n)
        vs_reference, vs_champion = intervals(level)
        calls = [i for i in (vs_reference, vs_champion) if i is not None]
        stopped = None
        if all(not_worse_than("", "", i, -margin, "").undecided is None for i in calls):
            stopped = "decided"
        elif n == sizes[-1]:
            stopped = f"budget of {n} rows reached" if n == budget else f"the suite has no more rows ({n})"
        looks.append(Look(n, level, vs_reference.to_dict(), None if vs_champion is None else vs_champion.to_dict(),
                          stopped))
        if stopped:
            break
    return tuple(looks)


def correct(suite: RegressionSuite, responses: Sequence[str], start: int = 0) -> list[bool]:
    """Per row from `start` on, one per response, whether the suite's checker accepts the
    response. A checker scores 0 or 1."""
    prompts, answers = suite.prompts[start:start + len(responses)], suite.answers[start:start + len(responses)]
    if len(responses) != len(prompts):
        raise ValueError(f"regression suite {suite.name}: {len(responses)} responses for {len(prompts)} rows "
                         f"from row {start}")
    return check_answers(prompts, responses, answers, suite.checker, where=f"regression suite {suite.name}")


def suite_report(suites: Sequence[RegressionSuite], candidate: EvalFigures, reference: EvalFigures,
                 champion: EvalFigures | None) -> list[dict]:
    """Per suite, for the gate report: its file, checker, margin, the rows answered and its
    budget, the candidate's looks, each policy's accuracy, and the candidate's paired intervals
    of the difference at the last look (None: point estimates)."""
    rows = []
    for i, suite in enumerate(suites):
        mine = candidate.regression[i]
        rows.append({
            "name": suite.name, "path": str(suite.path), "checker": suite.checker, "margin": suite.margin,
            "rows": mine.looks[-1].rows if mine.looks else suite.first_look, "max_rows": len(suite.prompts),
            "looks": [asdict(look) for look in mine.looks], "candidate": mine.accuracy,
            "reference": reference.regression[i].accuracy,
            "champion": None if champion is None else champion.regression[i].accuracy,
            "diff_vs_reference": None if mine.diff_vs_reference is None else mine.diff_vs_reference.to_dict(),
            "diff_vs_champion": None if mine.diff_vs_champion is None else mine.diff_vs_champion.to_dict(),
        })
    return rows
