"""docs/configuration.md, generated from the config models in `rlhf_core.config`.

    python -m rlhf_core.config.doc [PATH]     write the page (default docs/configuration.md)
    python -m rlhf_core.config.doc --check    exit 1 when the committed page is out of date

Every key is listed as a dotted path with its type (and bounds), default and meaning, grouped
by section under the section model's docstring. The meaning is the field's `description`, so
the page and the code cannot disagree: `tests/test_docs_configuration.py` regenerates it.
"""
from __future__ import annotations

import inspect
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from rlhf_core.config.pipeline import PipelineConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
INTRO = """# Configuration

Every run reads one YAML file and the bases it names ([overlays](#overlays)): `rlhf run` reads
`configs/own-data.yaml` unless given `--config` (your data; the defaults describe no task),
`rlhf demo` and the other commands `configs/demo.yaml`. Every key is optional and falls back to
the default below.
Unknown keys, wrong types and out-of-range values are rejected before anything runs, naming the
key. Override any key on the command line with `--set key.path=value` (the value is read as
YAML), e.g. `rlhf demo --set sft.epochs=2`.

This page is generated from the models in `rlhf_core/config/` by `make docs`; do not edit it by hand.

## Overlays

A config file may start from others and hold only what it changes: `base: own-data.yaml`
names a file relative to the overlay's own folder (`base: packaged:own-data.yaml` is the
packaged one, wherever the overlay lives), `base: [own-data.yaml, k8s.yaml]` several, merged in
that order, and a base may name bases of its own. The files are merged from the deepest base
up: mappings merge key by key, anything else (a list, a scalar, null) replaces the base's
value; `--set` applies after all files. The shipped configs compose this way: `own-data.yaml`
(the defences against reward hacking, no task), `demo.yaml` (it plus the demo's task and
recipe), `k8s.yaml` (where a run goes on the cluster, placement only), `k8s-demo.yaml` and the
GPU configs. A shipped config holds no key that would have its value anyway, and sets no key
back to its default over a base (tests check both).

`rlhf check-config PATH --explain` prints every resolved value and where it came from:
`default`, the file or base that set it, or `--set`.
"""
_BOUNDS = ((annotated_types.Ge, "≥", "ge"), (annotated_types.Gt, ">", "gt"),
           (annotated_types.Le, "≤", "le"), (annotated_types.Lt, "<", "lt"))


def sections(model: type[BaseModel] = PipelineConfig, prefix: str = "") -> list[tuple[str, type[BaseModel]]]:
    """`(dotted prefix, model)` for the model and every nested section, depth first."""
    out = [(prefix, model)]
    for name, field in model.model_fields.items():
        if _is_section(field):
            out += sections(field.annotation, f"{prefix}{name}.")
    return out


def undocumented(model: type[BaseModel] = PipelineConfig) -> list[str]:
    """Dotted keys whose field has no description, and sections whose model has no docstring."""
    missing = []
    for prefix, section in sections(model):
        if not (section.__doc__ or "").strip():
            missing.append(prefix.rstrip(".") or "<top level>")
        missing += [prefix + name for name, field in section.model_fields.items()
                    if not _is_section(field) and not (field.description or "").strip()]
    return missing


def render(model: type[BaseModel] = PipelineConfig) -> str:
    out = [INTRO]
    for prefix, section in sections(model):
        keys = [(name, f) for name, f in section.model_fields.items() if not _is_section(f)]
        if not keys:
            continue
        out += [f"## {'`' + prefix.rstrip('.') + '`' if prefix else 'Top level'}", "",
                inspect.cleandoc(section.__doc__ or ""), "",
                "| key | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{prefix}{name}` | {_cell(_type(f))} | {_cell(_default(f))} | {_cell(f.description or '')} |"
                for name, f in keys]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _is_section(field: FieldInfo) -> bool:
    return isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)


def _type(field: FieldInfo) -> str:
    text = _type_name(field.annotation)
    bounds = [f"{sign} {getattr(m, attr):g}" for m in field.metadata for cls, sign, attr in _BOUNDS
              if isinstance(m, cls)]
    return text + (", " + ", ".join(bounds) if bounds else "")


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:  # a type with its validators: the type is what a reader needs
        return _type_name(args[0])
    if origin is Literal:
        return " \\| ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(names) + (" \\| null" if type(None) in args else "")
    if origin in (list, tuple):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("\n", " ").replace("|", "\\|").replace("\\\\|", "\\|")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    missing = undocumented()
    if missing:
        print("no description: " + ", ".join(missing), file=sys.stderr)
        return 1
    if args[:1] == ["--check"]:
        if not PAGE.is_file() or PAGE.read_text(encoding="utf-8") != render():
            print(f"{PAGE} is out of date: run `make docs`", file=sys.stderr)
            return 1
        return 0
    target = Path(args[0]) if args else PAGE
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render(), encoding="utf-8")
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
