"""The pieces every section of docs/benchmarks.md is made of (`bench/report.py`): a result
file, a Markdown table, the line that says where a result was measured, and the line for a
benchmark not run yet."""
from __future__ import annotations

import json
from pathlib import Path

from bench.common import RESULTS


Columns = list[tuple[str, str, str]]  # (key in the row, column title, format spec; "" = str())


def load(name: str, results: Path = RESULTS) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def md_table(rows: list[dict], columns: Columns) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(key), fmt) for key, _, fmt in columns) + " |" for r in rows]
    return "\n".join(lines)


def _cell(value, fmt: str) -> str:
    if value is None:
        return "–"
    text = format(value, fmt) if fmt else str(value)
    return text.replace("|", "\\|").replace("\n", " ")  # a free-text cell must not break the table


def measured_on(result: dict, name: str) -> str:
    """Where a result file was measured, without its date (the file has it; history is git's)."""
    m = result.get("machine") or {}
    parts = [m.get("cpu", "an unknown CPU")]
    if m.get("cores"):
        parts.append(f"{m['cores']} cores")
    if m.get("ram_gib"):
        parts.append(f"{m['ram_gib']} GiB")
    if m.get("gpu"):
        parts.append(f"{m['gpu']} (CUDA {m.get('cuda')})")
    parts += [f"{label} {m[key]}" for key, label in (("python", "Python"), ("torch", "torch"), ("vllm", "vLLM"))
              if m.get(key)]
    return f"Measured on {', '.join(parts)} (`bench/results/{name}.json`)."


def not_run(name: str, script: str) -> list[str]:
    return [f"No results yet (`bench/results/{name}.json`): run `.venv/bin/python bench/{script}`."]
