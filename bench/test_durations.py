"""Where the test suite's time goes: pytest's `--durations=0` report as tables.

    .venv/bin/python -m pytest --durations=0 -p no:cacheprovider | tee /tmp/suite.log
    .venv/bin/python bench/test_durations.py /tmp/suite.log [--label before]

pytest reports each test's set-up, call and tear-down separately; a set-up that starts a
module- or session-scoped fixture (a Ray cluster, a vLLM server, a pipeline run) is charged
to the first test that asks for it, so the set-up rows are where shared fixtures show. The
script prints the total, the time per module (split by phase) and the slowest rows, and
writes them to `bench/results/test_durations[_LABEL].json`.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import save, table  # noqa: E402

ROW = re.compile(r"^\s*(?P<seconds>\d+(?:\.\d+)?)s\s+(?P<phase>setup|call|teardown)\s+(?P<nodeid>\S+)")
CLOSING = re.compile(r"=+ (?P<summary>.*?) in (?P<seconds>[\d.]+)s(?: \(.*\))? =+")


def parse(text: str) -> tuple[list[dict], dict]:
    """The `--durations` rows and pytest's closing line (`{"summary": ..., "seconds": ...}`)."""
    rows = [{"seconds": float(m["seconds"]), "phase": m["phase"], "nodeid": m["nodeid"]}
            for m in map(ROW.match, text.splitlines()) if m]
    closing = next((m.groupdict() for m in reversed([CLOSING.search(line) for line in text.splitlines()]) if m), {})
    return rows, {"summary": closing.get("summary", ""), "seconds": float(closing.get("seconds", 0.0))}


def by_module(rows: list[dict]) -> list[dict]:
    """Seconds per test module, split by phase, slowest module first."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: {"setup": 0.0, "call": 0.0, "teardown": 0.0})
    for row in rows:
        totals[row["nodeid"].split("::")[0]][row["phase"]] += row["seconds"]
    return sorted(({"module": module, **phases, "total": sum(phases.values())} for module, phases in totals.items()),
                  key=lambda r: -r["total"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path, help="pytest output with --durations=0")
    parser.add_argument("--label", default="", help="suffix of the JSON file (e.g. before, after)")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    rows, closing = parse(args.log.read_text(errors="replace"))
    if not rows:
        sys.exit(f"{args.log}: no --durations rows found (run pytest with --durations=0)")
    modules = by_module(rows)
    slowest = sorted(rows, key=lambda r: -r["seconds"])[: args.top]
    print(f"pytest: {closing['summary']} in {closing['seconds']:.0f} s; "
          f"{sum(r['seconds'] for r in rows):.0f} s in the reported phases")
    print(table([{k: round(v, 1) if isinstance(v, float) else v for k, v in m.items()} for m in modules],
                ["module", "setup", "call", "teardown", "total"]))
    print(f"\nThe {args.top} slowest phases (a set-up row is a fixture started for that test):")
    print(table(slowest, ["seconds", "phase", "nodeid"]))
    name = "test_durations" + (f"_{args.label}" if args.label else "")
    save(name, {"closing": closing, "modules": modules, "slowest": slowest})


if __name__ == "__main__":
    main()
