"""Loading a pipeline config: YAML files, `key.path=value` overrides, then validation into a
`PipelineConfig`, with every bad key named in one `ConfigError`:

    policy.ppo.clip_range: must be > 0, got -1

A file may name a `base` (or a list of them) and hold only what it changes (an overlay):

    base: [own-data.yaml, k8s.yaml]   # relative to this file's folder; `packaged:NAME` is a packaged one
    model: {pretrained: Qwen/Qwen2.5-7B-Instruct}

Bases may chain. A list's bases are merged in its order, each with its own bases first; the
files are merged from the deepest base up: mappings merge key by key,
anything else (lists, scalars, null) replaces what the base had. `--set` overrides apply after
all files; keys no layer sets keep the model's default. `config_origins` says which of these
each value of the resolved config came from.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rlhf_core.config.default import DEFAULT_CONFIG
from rlhf_core.config.pipeline import PipelineConfig

BASE_KEY = "base"
PACKAGED = "packaged:"  # `base: packaged:NAME` is configs/NAME of the installed package
DEFAULT, SET = "default", "--set"


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


def parse_config(raw: dict[str, Any] | None, source: str = "config",
                 origins: dict[str, str] | None = None) -> PipelineConfig:
    """Validate a plain dict into a `PipelineConfig`, or raise `ConfigError` naming every bad key.

    With `origins` (key path -> where it was set, as `resolve` returns them) from more than one
    place, each problem also names the file (or `--set`) its key came from."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([f"<root>: must be a mapping, got {type(raw).__name__}"], source)

    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        named = origins is not None and len(set(origins.values())) > 1
        problems = [_describe(e) + (_from(origins, e["loc"]) if named else "") for e in exc.errors()]
        raise ConfigError(problems, source) from None


def _from(origins: dict[str, str], loc: tuple) -> str:
    origin = origin_of(origins, ".".join(str(p) for p in loc))
    return "" if origin == DEFAULT else f" (from {origin})"


# --- layers -------------------------------------------------------------------------------


def _read(path: Path, source: str, base_of: str | None) -> dict[str, Any]:
    """The mapping in the file at `path`; `base_of`: the file that named it as its base."""
    where = f" (the base of {base_of})" if base_of else ""
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError([f"file not found: {path}{where}"], source) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"not valid YAML{where}: {exc}"], source) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError([f"<root>: must be a mapping, got {type(raw).__name__}{where}"], source)
    return raw


def _base_path(base: Any, of: Path) -> Path:
    if not isinstance(base, str) or not base.strip():
        raise ConfigError([f"{BASE_KEY}: must be the path of a config file, got {base!r}"], str(of))
    if base.startswith(PACKAGED):
        return Path(DEFAULT_CONFIG).parent / base.removeprefix(PACKAGED)
    path = Path(base).expanduser()
    return path if path.is_absolute() else Path(os.path.normpath(of.parent / path))


def read_chain(path: str | Path, _within: tuple[str, ...] = ()) -> list[tuple[str, dict[str, Any]]]:
    """The file at `path` and the bases it names, in merge order (its bases' layers, each base's
    own first, then the file), as (the file's path, its keys without `base`). A base that names a
    file already on the way to it is refused."""
    current, resolved = Path(path), str(Path(path).resolve())
    names = [*_within, str(current)]
    if resolved in [str(Path(p).resolve()) for p in _within]:
        raise ConfigError([f"{BASE_KEY}: the bases form a cycle: {' -> '.join(names)}"], names[0])
    raw = dict(_read(current, names[0], _within[-1] if _within else None))
    bases = raw.pop(BASE_KEY, None)
    if bases is not None and not isinstance(bases, list):
        bases = [bases]
    if bases == []:
        raise ConfigError([f"{BASE_KEY}: an empty list; name a config file, or leave the key out"], str(current))
    layers: list[tuple[str, dict[str, Any]]] = []
    for base in bases or ():
        layers += read_chain(_base_path(base, current), tuple(names))
    return [*layers, (str(current), raw)]


def _forget(origins: dict[str, str], key: str) -> None:
    for k in [k for k in origins if k == key or k.startswith(key + ".")]:
        del origins[k]


def _record(origins: dict[str, str], key: str, value: Any, label: str) -> None:
    """`key` (and every key under it, when `value` is a mapping) now comes from `label`."""
    _forget(origins, key)
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _record(origins, f"{key}.{k}", v, label)
    else:
        origins[key] = label


def merge(into: dict[str, Any], layer: dict[str, Any], label: str, origins: dict[str, str],
          prefix: str = "") -> None:
    """Deep-merge `layer` into `into` in place: a mapping met by a mapping merges key by key,
    anything else replaces. `origins` learns that every key `layer` sets comes from `label`."""
    for key, value in layer.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value, label, origins, path + ".")
        else:
            into[key] = copy.deepcopy(value)
            _record(origins, path, value, label)


def _override(out: dict[str, Any], item: str, origins: dict[str, str]) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError([f"override {item!r}: expected key.path=value"])
    node, parts, listed = out, key.split("."), None  # listed: the key of the first list on the way
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):  # an item of a list by its index: gates.regression_suites.0.max_rows
            listed = listed or ".".join(parts[:i])
            node = node[_index(node, part, key)]
        else:
            node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError([f"{key}: {part} is not a mapping"])
    if isinstance(node, list):
        listed = listed or ".".join(parts[:-1])
    last = _index(node, parts[-1], key) if isinstance(node, list) else parts[-1]
    node[last] = yaml.safe_load(value)
    if listed:  # a list is one value: it now comes from --set as a whole
        origins[listed] = SET
    else:
        _record(origins, key, node[last], SET)


def _index(items: list, part: str, key: str) -> int:
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError([f"{key}: {part} is not an index of a list of {len(items)} items"])
    return int(part)


def apply_overrides(raw: dict[str, Any], overrides: list[str],
                    origins: dict[str, str] | None = None) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict, returning a copy.
    The value replaces what was at `a.b.c`, a mapping too. `origins` learns the keys they set."""
    out = yaml.safe_load(yaml.safe_dump(raw)) or {}
    for item in overrides:
        _override(out, item, {} if origins is None else origins)
    return out


def resolve(path: str | Path, overrides: list[str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The raw config of `path` with its bases merged and the overrides applied, and where each
    key it sets came from: key path -> the file's path, or `--set`."""
    raw: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for label, layer in read_chain(path):
        merge(raw, layer, label, origins)
    return apply_overrides(raw, overrides or [], origins), origins


def load_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Load a pipeline config from a YAML file (and its bases), override and validate it."""
    raw, origins = resolve(path, overrides)
    return parse_config(raw, source=str(path), origins=origins)


# --- where values come from ---------------------------------------------------------------


def origin_of(origins: dict[str, str], key: str) -> str:
    """Where `key` got its value: the layer that set it or a mapping above it, else `default`."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in origins:
            return origins[".".join(parts[:n])]
    below = [label for k, label in origins.items() if k.startswith(key + ".")]
    return below[-1] if below else DEFAULT


def leaf_keys(model: Any, prefix: str = "") -> list[str]:
    """Dotted keys of every value of a config model: its fields, nested sections walked into."""
    from pydantic import BaseModel

    keys = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        keys += leaf_keys(value, f"{prefix}{name}.") if isinstance(value, BaseModel) else [prefix + name]
    return keys


def config_origins(path: str | Path, overrides: list[str] | None = None) -> dict[str, str]:
    """Every key of the resolved config of `path` (dotted, in the models' order) -> where its
    value came from: `default`, the path of the file or base that set it, or `--set`.
    Raises `ConfigError` as `load_config` does."""
    raw, origins = resolve(path, overrides)
    cfg = parse_config(raw, source=str(path), origins=origins)
    return {key: origin_of(origins, key) for key in leaf_keys(cfg)}


def restated_keys(path: str | Path) -> list[str]:
    """Keys the file at `path` itself sets to the value they would have without it: the model's
    default, or for an overlay, its bases' value. A key that sets an overlay back to the
    default (`policy.precision: auto` over a base's fp32) changes something and is not listed."""
    return _own_keys_where(path, lambda value, without, default: value == without)


def undone_keys(path: str | Path) -> list[str]:
    """Keys the file at `path` sets back to the model's default over a base that changed them
    (`policy.verifiable_reward: null` over the demo's checker): an overlay undoing its base."""
    return _own_keys_where(path, lambda value, without, default: value == default != without)


def _own_keys_where(path: str | Path, test) -> list[str]:
    """Keys the file at `path` sets whose resolved value, the value without the file's key and
    the model's default pass `test(value, without, default)`."""
    *bases, (_, own) = read_chain(path)
    defaults = PipelineConfig().model_dump(mode="json")
    under: dict[str, Any] = {}
    for label, layer in bases:
        merge(under, layer, label, {})
    without = parse_config(under, source=str(path)).model_dump(mode="json")
    restated = []
    for key in _own_leaves(own):
        with_key = copy.deepcopy(under)
        merge(with_key, _nested(key, _get(own, key)), "", {})
        try:
            value, default = _get(parse_config(with_key).model_dump(mode="json"), key), _get(defaults, key)
        except (ConfigError, KeyError):
            continue  # invalid or not a config value: the validation of the file says so
        if test(value, _get(without, key), default):
            restated.append(key)
    return restated


def _own_leaves(raw: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in raw.items():
        out += _own_leaves(value, f"{prefix}{key}.") if isinstance(value, dict) and value else [prefix + str(key)]
    return out


def _get(tree: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        tree = tree[part]
    return tree


def _nested(key: str, value: Any) -> dict[str, Any]:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value
