"""Loading a pipeline config: YAML file, `key.path=value` overrides, then validation into a
`PipelineConfig`, with every bad key named in one `ConfigError`:

    policy.ppo.clip_range: must be > 0, got -1
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

class ConfigError(ValueError):
    """A config that cannot be used. `problems` holds one `key.path: message` per error."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        super().__init__(f"{source}: invalid configuration\n  " + "\n  ".join(problems))


_MESSAGES = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "extra_forbidden": "unknown key",
    "missing": "required key is missing",
}


def _describe(err: dict[str, Any]) -> str:
    path = ".".join(str(p) for p in err["loc"]) or "<root>"
    kind = err["type"]
    if kind in _MESSAGES:
        ctx = {k: f"{v:g}" if isinstance(v, float) else v for k, v in err.get("ctx", {}).items()}
        msg = _MESSAGES[kind].format(**ctx)
    else:
        msg = err["msg"].removeprefix("Value error, ")
    if kind not in ("missing", "extra_forbidden") and err["loc"]:
        msg += f", got {err['input']!r}"
    return f"{path}: {msg}"


def parse_config(raw: dict[str, Any] | None, source: str = "config") -> PipelineConfig:
    """Validate a plain dict into a `PipelineConfig`, or raise `ConfigError` naming every bad key."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([f"<root>: must be a mapping, got {type(raw).__name__}"], source)
    from rlhf_core.config import PipelineConfig  # here, not above: rlhf_core.config re-exports this module

    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError([_describe(e) for e in exc.errors()], source) from None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict, returning a copy."""
    out = yaml.safe_load(yaml.safe_dump(raw)) or {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError([f"override {item!r}: expected key.path=value"])
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError([f"{key}: {part} is not a mapping"])
        node[parts[-1]] = yaml.safe_load(value)
    return out


def load_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Load, override and validate a pipeline config from a YAML file."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError([f"file not found: {path}"], str(path)) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"not valid YAML: {exc}"], str(path)) from None
    return parse_config(apply_overrides(raw, overrides or []), source=str(path))
