"""The base preference data plus the collected feedback datasets: what a run trains on.

`recent_exports` lists the feedback datasets `collect-feedback` wrote (their manifests) within
the recency window; `mix` appends a `weight` share of their pairs (a seeded sample) to the base
rows, in the base data's format, leaving out pairs the data holds already. The result is written as
one preference file and goes through the same preparation and contract as the base data alone.

`labelled_answers` takes the same share of their thumbs (each a single answer rated up or down,
no pair needed): what KTO learns from beside the pairs. An answer rated both ways across
exports is left out, as the export leaves it out within one.
"""
from __future__ import annotations

import json
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_core.data.formats import is_conversation

MANIFEST = "manifest.json"
PAIR_COLUMNS = ("prompt", "chosen", "rejected")


class FeedbackMixError(ValueError):
    """Feedback that cannot be mixed into the base data (a different format)."""


@dataclass(frozen=True)
class FeedbackExportInfo:
    version: str
    path: Path
    created_at: float
    fingerprint: str
    served_versions: tuple[str, ...]
    pairs: int
    report: tuple[str, ...] = ()  # what the export kept, dropped and why (`FeedbackDataset.report`)


def recent_exports(root: Path, recency_days: float | None, now: float | None = None) -> list[FeedbackExportInfo]:
    """The feedback datasets under `root` exported in the last `recency_days` days (all: None),
    oldest first. Directories without a manifest (an export in progress) are not datasets."""
    now = time.time() if now is None else now
    found = []
    for manifest_path in sorted(Path(root).glob(f"*/{MANIFEST}")):
        if manifest_path.parent.name.startswith("."):
            continue
        m = json.loads(manifest_path.read_text())
        if recency_days is not None and now - m["created_at"] > recency_days * 86400:
            continue
        found.append(FeedbackExportInfo(m["version"], manifest_path.parent, m["created_at"], m["fingerprint"],
                                        tuple(sorted(m["served_versions"])), m["pairs"], tuple(m.get("report", ()))))
    return sorted(found, key=lambda e: e.created_at)


def _format(value: Any) -> str:
    return "conversational" if is_conversation(value) else "standard"


def data_format(rows: Sequence[Mapping]) -> str | None:
    """"conversational" or "standard", as the first row's prompt is written; None when there is
    no row or no prompt column (an implicit prompt) to tell."""
    return _format(rows[0]["prompt"]) if rows and "prompt" in rows[0] else None


def _key(row: Mapping) -> str:
    return json.dumps([row[k] for k in PAIR_COLUMNS], sort_keys=True)


@dataclass(frozen=True)
class Mixed:
    rows: list[dict]  # the base rows followed by the feedback pairs taken
    taken: dict[str, int]  # pairs taken per feedback version
    already_present: int  # feedback pairs left out: the same (prompt, chosen, rejected) was there already


def mix(base: Sequence[Mapping], exports: Sequence[FeedbackExportInfo], weight: float, seed: int = 0,
        where: str = "the base preference data") -> Mixed:
    """The base rows followed by a `weight` share of each export's pairs (a seeded sample; all
    at 1.0). A pair whose (prompt, chosen, rejected) is already in the base data or an earlier
    export is left out and counted: it adds nothing, and the data contract refuses repeated
    pairs. A feedback pair has the base rows' `id` and `source` columns when they do:
    `<version>-<pair>` and `feedback:<version>`."""
    if not 0 <= weight <= 1:
        raise ValueError(f"feedback weight {weight}: a share of the feedback pairs, between 0 and 1")
    rows = [dict(r) for r in base]
    base_format = data_format(rows)
    with_id, with_source = bool(rows) and "id" in rows[0], bool(rows) and "source" in rows[0]
    seen = {_key(r) for r in rows if all(k in r for k in PAIR_COLUMNS)}
    rng = random.Random(seed)
    taken: dict[str, int] = {}
    already_present = 0
    for export in exports:
        pairs = [json.loads(line) for line in (export.path / "preferences.jsonl").read_text().splitlines() if line]
        taken[export.version] = 0
        for i, pair in enumerate(pairs):
            if base_format is not None and _format(pair["prompt"]) != base_format:
                raise FeedbackMixError(
                    f"{export.path}/preferences.jsonl line {i + 1}: a {_format(pair['prompt'])} pair, but {where} "
                    f"is {base_format}; serve the model the way its data is written (chat completions for "
                    "conversational data, completions for text), or leave this feedback out (feedback.use: false)")
            if weight < 1 and rng.random() >= weight:
                continue
            if (key := _key(pair)) in seen:
                already_present += 1
                continue
            seen.add(key)
            row = {k: pair[k] for k in PAIR_COLUMNS}
            if with_id:
                row = {"id": f"{export.version}-{i:06d}", **row}
            if with_source:
                row["source"] = f"feedback:{export.version}"
            rows.append(row)
            taken[export.version] += 1
    return Mixed(rows, taken, already_present)


@dataclass(frozen=True)
class LabelledAnswers:
    rows: list[dict]  # {prompt, completion, desirable, source}: one per distinct answer
    taken: dict[str, int]  # answers taken per feedback version
    contradictory: int  # answers left out: rated up in one export and down in another
    blank: int = 0  # answers left out: no text to learn from


def labelled_answers(exports: Sequence[FeedbackExportInfo], weight: float, seed: int = 0,
                     base_format: str | None = None, where: str = "the base preference data") -> LabelledAnswers:
    """A `weight` share (a seeded sample) of the thumbs in the exports' `ratings.jsonl`, one row
    per distinct (prompt, answer): many users rating one answer alike make one example. In the
    base data's format (`base_format`, "standard" or "conversational"; None: any)."""
    if not 0 <= weight <= 1:
        raise ValueError(f"feedback weight {weight}: a share of the feedback answers, between 0 and 1")
    rng = random.Random(f"answers:{seed}")
    found: dict[str, dict] = {}
    labels: dict[str, set[bool]] = {}
    taken: dict[str, int] = {}
    blank = 0
    for export in exports:
        path = export.path / "ratings.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
        taken[export.version] = 0
        for i, row in enumerate(rows):
            if not isinstance(row.get("label"), bool):
                raise FeedbackMixError(f"{path} line {i + 1}: 'label' is {row.get('label')!r}, not true or false")
            if base_format is not None and _format(row["prompt"]) != base_format:
                raise FeedbackMixError(
                    f"{path} line {i + 1}: a {_format(row['prompt'])} answer, but {where} is {base_format}; serve "
                    "the model the way its data is written, or leave this feedback out (feedback.use: false)")
            if weight < 1 and rng.random() >= weight:
                continue
            if not _text(row["completion"]).strip():
                blank += 1
                continue
            key = json.dumps([row["prompt"], row["completion"]], sort_keys=True)
            labels.setdefault(key, set()).add(row["label"])
            if key not in found:
                found[key] = {"prompt": row["prompt"], "completion": row["completion"], "desirable": row["label"],
                              "source": f"feedback:{export.version}"}
                taken[export.version] += 1
    contradictory = [k for k, seen in labels.items() if len(seen) > 1]
    for key in contradictory:
        version = found.pop(key)["source"].removeprefix("feedback:")
        taken[version] -= 1
    return LabelledAnswers(list(found.values()), taken, len(contradictory), blank)


def _text(value: Any) -> str:
    """An answer's text: itself, or its messages' contents."""
    return value if isinstance(value, str) else "".join(str(m.get("content", "")) for m in value)
