"""The safetensors files of a Hugging Face model directory, and whether their headers read.

Light on purpose (no torch): the deploy path uses it before it starts a server."""
from __future__ import annotations

import json
from pathlib import Path

INDEX = "model.safetensors.index.json"


def weight_files(path: Path) -> list[Path]:
    """The shards the directory's index names (missing ones included), else every
    `*.safetensors` file in it; [] when there are none."""
    index = path / INDEX
    if index.is_file():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    return sorted(path.glob("*.safetensors"))


def unreadable_weights(path: Path) -> str | None:
    """Why the directory's safetensors weights cannot be loaded, from their headers alone (no
    tensor is read): an index that does not parse, a shard it names that is missing, a header
    that does not parse, or tensors that run past the end of their file (a truncated copy).
    None when every header reads, and when there are no safetensors files (other formats are
    the loader's business)."""
    from safetensors import SafetensorError, safe_open  # noqa: PLC0415 - only when checking

    try:
        files = weight_files(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{path / INDEX} cannot be read: {e!r}"
    for file in files:
        if not file.is_file():
            return f"{file.name} is missing ({INDEX} names it)"
        try:
            with safe_open(str(file), "numpy"):  # parses and checks the header, maps nothing
                pass
        except (SafetensorError, OSError) as e:
            return f"{file} cannot be read: {e}"
    return None
