"""Preference rounds on the policy's own answers: label, check, and train the reward model on.

Production RLHF does not train one reward model once: it collects new preferences on the
latest policy's answers and refreshes the reward model, round after round (Bai et al. 2022,
"iterated online RLHF"; Touvron et al. 2023, Llama 2 §3.2.3). A reward model trained on the
SFT policy's answers is off-distribution once the policy moves, and that is where the policy
finds the answers it over-rates. A round here (driven by the policy worker, every
`policy.rounds.every` RL steps):

    answers      two samples of the current policy for each of `rounds.prompts` fresh prompts
    annotate     an `Annotator` prefers one answer, or gives no label (tie, refusal, malformed
                 reply), each outcome counted: the labels asked for are the round's cost
    contract     the new pairs pass the preference-data contract (`rlhf_core.data.validation`);
                 rows it names are dropped, a round it fails without naming rows is dropped whole
    train        the reward model continues on the new pairs plus `replay` earlier pairs per new
                 one (Bradley-Terry, each ensemble member on its own bootstrap weights), and
                 its normalisation stats are recomputed on them

Annotators: `SimulatedAnnotator` (the task's answer key with label noise, standing in for
raters who disagree), `JudgeAnnotator` (an LLM behind an OpenAI-compatible endpoint) and
`QueueAnnotator` (a batch for people; see its docstring for the file format).
"""
from __future__ import annotations

import json
import os
import random
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import pandas as pd
import torch

from rlhf_core.algos.losses import ensemble_bradley_terry_loss
from rlhf_core.config import JudgeConfig, RoundsConfig, ValidationConfig
from rlhf_core.data.pairs import collate_pairs, tokenize_pairs
from rlhf_core.data.schema import write_jsonl
from rlhf_core.models.reward import RewardStats, member_mean, reward_stats, score_pairs_members


@dataclass(frozen=True)
class Item:
    """Two answers of the policy to one prompt, to be compared."""

    prompt: str
    answer_a: str
    answer_b: str


@dataclass
class Annotated:
    """An annotator's output: the pairs it labelled and what happened to every item asked."""

    pairs: list[dict[str, str]] = field(default_factory=list)  # prompt, chosen, rejected
    counts: Counter = field(default_factory=Counter)  # asked, labelled, tie, malformed, refused, error, queued, ...


class Annotator(Protocol):
    def annotate(self, items: Sequence[Item], round_id: str) -> Annotated: ...


def _pair(item: Item, a_wins: bool) -> dict[str, str]:
    chosen, rejected = (item.answer_a, item.answer_b) if a_wins else (item.answer_b, item.answer_a)
    return {"prompt": item.prompt, "chosen": chosen, "rejected": rejected}


class SimulatedAnnotator:
    """The answer key as a rater: the correct answer is preferred over a wrong one; two right or
    two wrong answers get no label (`tie`); each label is flipped with probability `noise`.

    `correct(prompts, responses) -> (B,) 0/1` is the task's verifiable reward."""

    def __init__(self, correct: Callable[[list[str], list[str]], torch.Tensor], noise: float, seed: int):
        if not 0 <= noise < 0.5:
            raise ValueError(f"label noise must be in [0, 0.5), got {noise}")
        self.correct, self.noise, self.rng = correct, noise, random.Random(seed)

    def annotate(self, items: Sequence[Item], round_id: str) -> Annotated:
        out = Annotated()
        prompts = [i.prompt for i in items]
        right_a = self.correct(prompts, [i.answer_a for i in items]).tolist()
        right_b = self.correct(prompts, [i.answer_b for i in items]).tolist()
        for item, a, b in zip(items, right_a, right_b):
            out.counts["asked"] += 1
            if a == b:
                out.counts["tie"] += 1
                continue
            a_wins = a > b
            if self.rng.random() < self.noise:
                a_wins, out.counts["flipped"] = not a_wins, out.counts["flipped"] + 1
            out.pairs.append(_pair(item, a_wins))
            out.counts["labelled"] += 1
        return out


_VERDICT = re.compile(r"\[\[\s*([AB])\s*\]\]|^\s*\(?([AB])\)?[\s.:!]*$")


def parse_verdict(reply: str) -> str | None:
    """'A' or 'B' from a judge's reply: `[[A]]` anywhere (MT-Bench's format, Zheng et al. 2023)
    or the letter alone; None for anything else, including a reply naming both."""
    found = {m.group(1) or m.group(2) for m in _VERDICT.finditer(reply.strip())}
    return found.pop() if len(found) == 1 else None


def parse_match_answer(reply: str, item: Item) -> str | None:
    """Reference-guided judging: the judge answered the question itself; the one answer equal
    to its reply (first line, stripped) wins. None when neither or both match."""
    lines = reply.strip().splitlines()
    own = lines[0].strip() if lines else ""
    a, b = item.answer_a.strip() == own, item.answer_b.strip() == own
    return None if not own or a == b else ("A" if a else "B")


class JudgeAnnotator:
    """An LLM judge behind an OpenAI-compatible endpoint; one request per item, greedy.

    A reply the parser cannot read is counted `malformed`, an empty reply or a content-filter
    finish `refused`, a failed request `error`: none of them becomes a label."""

    def __init__(self, cfg: JudgeConfig, client: httpx.Client | None = None):
        if cfg.base_url is None or cfg.model is None:
            raise ValueError("the llm_judge annotator needs rounds.judge.base_url and rounds.judge.model")
        key = os.environ.get(cfg.api_key_env)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.cfg = cfg
        self.client = client or httpx.Client(base_url=cfg.base_url.rstrip("/"), headers=headers, timeout=cfg.timeout_s)

    def _ask(self, text: str) -> tuple[str, str | None]:
        c = self.cfg
        if c.api == "chat":
            body = {"model": c.model, "messages": [{"role": "user", "content": text}], "max_tokens": c.max_tokens,
                    "temperature": 0.0}
            choice = self._post("/chat/completions", body)
            return (choice.get("message") or {}).get("content") or "", choice.get("finish_reason")
        choice = self._post("/completions", {"model": c.model, "prompt": text, "max_tokens": c.max_tokens,
                                             "temperature": 0.0})
        return choice.get("text") or "", choice.get("finish_reason")

    def _post(self, path: str, body: dict) -> dict:
        response = self.client.post(path, json=body)
        response.raise_for_status()
        return response.json()["choices"][0]

    def annotate(self, items: Sequence[Item], round_id: str) -> Annotated:
        out = Annotated()
        for item in items:
            out.counts["asked"] += 1
            try:
                reply, finish = self._ask(self.cfg.template.format(prompt=item.prompt, answer_a=item.answer_a,
                                                                   answer_b=item.answer_b))
            except (httpx.HTTPError, KeyError, IndexError, ValueError):
                out.counts["error"] += 1
                continue
            if finish == "content_filter" or not reply.strip():
                out.counts["refused"] += 1
                continue
            verdict = parse_verdict(reply) if self.cfg.parser == "verdict" else parse_match_answer(reply, item)
            if verdict is None:
                out.counts["malformed"] += 1
                continue
            out.pairs.append(_pair(item, verdict == "A"))
            out.counts["labelled"] += 1
        return out


class QueueAnnotator:
    """Labelling by people, asynchronously, through a directory:

        <queue_dir>/pending/<round_id>.jsonl     written by a round: one item a line,
                                                  {"id", "prompt", "answer_a", "answer_b"}
        <queue_dir>/labelled/<any>.jsonl         returned by people: the same rows plus
                                                  "choice": "A" | "B" | "tie"
        <queue_dir>/consumed/<round_id>/<any>.jsonl
                                                  labelled files once a round took their pairs

    A round writes its batch and labels nothing now (training goes on with the reward model
    as it is); each round first picks up every labelled file, so labels returned after a run
    ended train the reward model in the next run's first round. Rows with another choice are
    counted `malformed` and skipped. Batches are written atomically (`rlhf_core.data.schema.write_jsonl`).

    Exactly once per round id: a round that is run again under the same id (the trainer
    resumed from a checkpoint taken before the round: it redoes it) takes the files it
    consumed the first time again, with any labelled since, and rewrites its own batch."""

    def __init__(self, queue_dir: Path):
        self.dir = Path(queue_dir)

    def annotate(self, items: Sequence[Item], round_id: str) -> Annotated:
        out = self._pick_up(round_id)
        pending = self.dir / "pending"
        pending.mkdir(parents=True, exist_ok=True)
        rows = [{"id": f"{round_id}-{k}", "prompt": i.prompt, "answer_a": i.answer_a, "answer_b": i.answer_b}
                for k, i in enumerate(items)]
        write_jsonl(rows, pending / f"{round_id}.jsonl")
        out.counts["queued"] += len(rows)
        return out

    def _pick_up(self, round_id: str) -> Annotated:
        out = Annotated()
        labelled, consumed = self.dir / "labelled", self.dir / "consumed" / round_id
        taken = sorted(consumed.glob("*.jsonl")) if consumed.is_dir() else []  # this round's, before a resume
        for path in taken + (sorted(labelled.glob("*.jsonl")) if labelled.is_dir() else []):
            for line in path.read_text(encoding="utf-8").splitlines():
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    item, choice = Item(row["prompt"], row["answer_a"], row["answer_b"]), row.get("choice")
                except (json.JSONDecodeError, KeyError, TypeError):
                    out.counts["malformed"] += 1
                    continue
                out.counts["picked_up"] += 1
                if choice == "tie":
                    out.counts["tie"] += 1
                elif choice in ("A", "B"):
                    out.pairs.append(_pair(item, choice == "A"))
                    out.counts["labelled"] += 1
                else:
                    out.counts["malformed"] += 1
            if path.parent != consumed:
                consumed.mkdir(parents=True, exist_ok=True)
                os.replace(path, consumed / path.name)
        return out


def make_annotator(cfg: RoundsConfig, correct: Callable | None, queue_dir: Path, seed: int) -> Annotator:
    if cfg.annotator == "simulated":
        if correct is None:
            raise ValueError("rounds.annotator simulated needs the task's answer key: set policy.verifiable_reward")
        return SimulatedAnnotator(correct, cfg.label_noise, seed)
    if cfg.annotator == "llm_judge":
        return JudgeAnnotator(cfg.judge)
    return QueueAnnotator(queue_dir)


def identical_items(items: Sequence[Item]) -> tuple[list[Item], int]:
    """Items whose two answers differ (only those are worth a label), and how many did not."""
    kept = [i for i in items if i.answer_a != i.answer_b]
    return kept, len(items) - len(kept)


def contract_filter(pairs: list[dict[str, str]], validation: ValidationConfig) -> tuple[list[dict[str, str]], int]:
    """The new pairs through the preference-data contract, sized for a round (no minimum row
    count, no duplicate-prompt limit). -> (the pairs it did not name, how many it dropped); a
    failed check that names fewer rows than it found drops the whole round."""
    from rlhf_core.data.validation import validate_preferences  # noqa: PLC0415 - Great Expectations is heavy

    if not pairs:
        return [], 0
    cfg = validation.model_copy(update={"min_rows": 1, "max_duplicate_prompt_share": 1.0, "sample_rows": 100,
                                        "check_eval_leakage": False})
    report = validate_preferences(pd.DataFrame(pairs), cfg)
    bad: set[int] = set()
    for check in report.checks:
        if check.success:
            continue
        if not check.lines or (check.unexpected_count or 0) > len(check.lines):
            return [], len(pairs)  # the contract failed the round as a whole
        bad |= set(check.lines)
    kept = [p for line, p in enumerate(pairs, start=1) if line not in bad]
    return kept, len(pairs) - len(kept)


def split_for_audit(pairs: list[dict[str, str]], share: float, seed: int) -> tuple[list, list]:
    """(pairs for the proxy, pairs for the audit model): each pair goes to the audit with
    probability `share`, drawn from `seed`, so the two never train on the same label."""
    rng = random.Random(seed)
    proxy, audit = [], []
    for pair in pairs:
        (audit if rng.random() < share else proxy).append(pair)
    return proxy, audit


def replay_sample(old: Sequence[Mapping[str, str]], n: int, seed: int) -> list[Mapping[str, str]]:
    """`n` earlier pairs drawn without replacement (all of them when there are fewer)."""
    old = list(old)
    return old if n >= len(old) else random.Random(seed).sample(old, n)


def train_reward_model_round(
    model: torch.nn.Module, tokenizer, pairs: Sequence[Mapping[str, str]], cfg: RoundsConfig, max_length: int,
    seed: int,
) -> tuple[tuple[RewardStats, ...], RewardStats, dict[str, float]]:
    """Continue training `model` (K heads) on `pairs` with AdamW; each member weights the
    pairs by its own Poisson(1) bootstrap when K > 1. -> (each member's normalisation stats,
    the members' mean's stats, `rounds/*` metrics), stats measured on `pairs` after training."""
    data = tokenize_pairs(pairs, tokenizer, max_length, "truncate")
    k = model.config.num_labels
    g = torch.Generator().manual_seed(seed)
    weights = torch.poisson(torch.ones(len(data), k), generator=g) if k > 1 else None
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW([p for p in model.parameters()], lr=cfg.learning_rate, weight_decay=0.0)
    model.train().requires_grad_(True)
    losses, accuracies = [], []
    for _ in range(cfg.epochs):
        order = torch.randperm(len(data), generator=g).tolist()
        for start in range(0, len(order), cfg.batch_size):
            idx = order[start : start + cfg.batch_size]
            batch = collate_pairs(data, idx)
            rewards = model(input_ids=batch.input_ids.to(device),
                            attention_mask=batch.attention_mask.to(device)).logits.float()  # (2B, K)
            loss, m = ensemble_bradley_terry_loss(rewards[: batch.num_pairs], rewards[batch.num_pairs :],
                                                  None if weights is None else weights[idx].to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
            accuracies.append(m["accuracy"])
    model.eval().requires_grad_(False)
    chosen, rejected = score_pairs_members(model, data)  # (K, N)
    members = tuple(reward_stats(torch.cat([c, r])) for c, r in zip(chosen, rejected))
    central = reward_stats(torch.cat([member_mean(chosen), member_mean(rejected)]))
    metrics = {"rounds/rm_loss": sum(losses[-5:]) / max(len(losses[-5:]), 1),
               "rounds/rm_train_accuracy": float((member_mean(chosen) > member_mean(rejected)).float().mean()),
               "rounds/rm_steps": float(len(losses))}
    return members, central, metrics


def module_state(model: torch.nn.Module) -> dict[str, Any]:
    """A CPU copy of a module's parameters, to broadcast to the other ranks."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
