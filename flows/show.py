"""What `rlhf env` and `rlhf validate --show N` print: the environment of a bug report
(`tasks.environment`) and preference rows as the trainer sees them (`tasks.inspect_data`).
Both load torch, so they are imported when asked for, not with the command line."""
from __future__ import annotations

import json


def print_environment(config_path: str, overrides: list[str], as_json: bool) -> int:
    from tasks.environment import collect_environment, format_environment  # noqa: PLC0415

    info = collect_environment(config_path, overrides)
    print(json.dumps(info, indent=2) if as_json else "Paste this into a bug report:\n\n" + format_environment(info))
    return 0


def print_rows(cfg, path: str, n: int) -> None:
    from tasks.inspect_data import show_rows  # noqa: PLC0415

    print(show_rows(cfg, path, n) + "\n")
