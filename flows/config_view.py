"""`rlhf check-config`: a pipeline config validated and printed resolved, as JSON, or with
`--explain` one line per key: its value and where it came from (`default`, the file or base
that set it, or `--set`)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rlhf_core.config import PipelineConfig, config_origins, load_config
from rlhf_core.eval.sequential import power_warnings


def print_config(path: str | Path, overrides: list[str], explain: bool) -> int:
    """Print the resolved config of `path` (raises `ConfigError` when it is not valid), and on
    stderr a warning for each regression suite too small to decide its margin."""
    cfg = load_config(path, overrides)
    for warning in power_warnings(cfg.gates.regression_suites, cfg.gates.confidence):
        print(f"warning: {warning}", file=sys.stderr)
    if explain:
        origins = config_origins(path, overrides)
        bases = set(origins.values()) - {str(path), "default", "--set"}
        print(explained(cfg, {key: f"{o} (base)" if o in bases else o for key, o in origins.items()}))
    else:
        print(json.dumps(cfg.model_dump(mode="json"), indent=2))
    return 0


def explained(cfg: PipelineConfig, origins: dict[str, str]) -> str:
    """`key  value  origin` lines, in the order of `origins`, the columns aligned."""
    values = cfg.model_dump(mode="json")
    rows = [(key, json.dumps(_get(values, key)), origin) for key, origin in origins.items()]
    key_width = max(len(key) for key, _, _ in rows)
    value_width = min(40, max(len(value) for _, value, _ in rows))
    return "\n".join(f"{key:<{key_width}}  {value:<{value_width}}  {origin}" for key, value, origin in rows)


def _get(tree: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        tree = tree[part]
    return tree
