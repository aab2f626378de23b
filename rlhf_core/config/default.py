"""Where the embedded demo config lives, wherever the code runs from.

`configs/` sits beside `rlhf_core/` both in a checkout and in an installed wheel (pyproject.toml
packages `configs/*.yaml` as package data), so the path is resolved from this file, never from
the working directory: `rlhf validate data.jsonl` works from any directory.
"""
from __future__ import annotations

from pathlib import Path

DEFAULT_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")
# What `rlhf run` trains without --config: your data, with the defences and no task of the demo's
OWN_DATA_CONFIG = str(Path(DEFAULT_CONFIG).with_name("own-data.yaml"))
