"""The preference-data contract: columns, reading, writing and fingerprinting.

Preference data is JSONL (one JSON object per line) or Parquet with the required text
columns `prompt`, `chosen`, `rejected` and the optional `id`, `source`. The optional
verifiable eval set has `prompt`, `answer`. What the values must satisfy (non-blank,
lengths, uniqueness, no eval leakage, ...) is checked by `rlhf_core.data.validation`.

`read_table` never fails on content, only on format: JSONL is read as bytes and each line
decoded with `errors="replace"`, so undecodable UTF-8 becomes U+FFFD (as do lone surrogate
escapes like `"\\ud800"`), which validation then reports with its line number. Every row
keeps `_line`, its 1-based line in the file (row number for Parquet), so reports can point
at the offending rows.

Files written by Windows tools often start with a UTF-8 byte-order mark and end lines with
CRLF: both are read as plain UTF-8 lines, and `df.attrs[READ_NOTES]` says so, for the
validation report. Columns beyond the contract's are kept in the frame and named by the
report; training reads the contract's columns by name only.
"""
from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

PREFERENCE_COLUMNS: tuple[str, ...] = ("prompt", "chosen", "rejected")
OPTIONAL_PREFERENCE_COLUMNS: tuple[str, ...] = ("id", "source")
EVAL_COLUMNS: tuple[str, ...] = ("prompt", "answer")
LINE_COLUMN = "_line"
READ_NOTES = "read_notes"  # key in DataFrame.attrs: how a file was read, when worth saying

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")

REPLACEMENT_CHAR = "\ufffd"  # what undecodable text becomes; validation rejects it
_SURROGATES = re.compile("[\ud800-\udfff]")


class DataFormatError(ValueError):
    """A file that cannot be read as a table: unknown suffix, or a line that is not a JSON object."""


def read_table(path: str | Path) -> pd.DataFrame:
    """Read a JSONL or Parquet file into a DataFrame with a 1-based `_line` column."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return _read_jsonl(path)
    if suffix in PARQUET_SUFFIXES:
        df = pd.read_parquet(path)
        df[LINE_COLUMN] = range(1, len(df) + 1)
        return df
    raise DataFormatError(
        f"{path}: unknown file type {suffix or '(no suffix)'!r}; "
        f"expected one of {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}"
    )


def _read_jsonl(path: Path) -> pd.DataFrame:
    rows: list[dict] = []
    bom = crlf = False
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw, bom = raw[len(codecs.BOM_UTF8):], True
            crlf = crlf or raw.endswith(b"\r\n")
            text = raw.decode("utf-8", errors="replace")
            if not text.strip():
                continue  # blank lines (e.g. a trailing one) carry no row
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataFormatError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise DataFormatError(
                    f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}"
                )
            obj = {k: replace_surrogates(v) for k, v in obj.items() if k != LINE_COLUMN}
            obj[LINE_COLUMN] = lineno
            rows.append(obj)
    df = pd.DataFrame.from_records(rows) if rows else pd.DataFrame({LINE_COLUMN: pd.Series([], dtype="int64")})
    df.attrs[READ_NOTES] = [note for note, seen in (("UTF-8 byte-order mark skipped", bom),
                                                    ("CRLF line ends", crlf)) if seen]
    return df


def prompt_key(prompt: Any) -> str | None:
    """A text prompt with its runs of whitespace collapsed, as the eval-leakage check compares
    prompts; None for anything else."""
    return " ".join(prompt.split()) if isinstance(prompt, str) else None


def replace_surrogates(value: Any) -> Any:
    """Replace lone UTF-16 surrogates (from JSON escapes like `\\ud800`) by U+FFFD.

    They are undecodable text too, and Arrow-backed pandas strings cannot hold them.
    Non-strings pass through unchanged.
    """
    if isinstance(value, str) and not value.isascii():
        return _SURROGATES.sub(REPLACEMENT_CHAR, value)
    return value


def write_jsonl(rows: Iterable[Mapping], path: str | Path) -> Path:
    """Write rows as JSONL, atomically and byte-for-byte deterministically.

    One `json.dumps(row, ensure_ascii=False)` per line in the rows' own key order, `\\n`
    line endings, UTF-8. The reader's `_line` key is dropped. NaN is rejected (not JSON).
    The file appears complete or not at all: written to a temp file in the same directory,
    fsynced, then moved into place with `os.replace`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for row in rows:
                record = {k: v for k, v in row.items() if k != LINE_COLUMN}
                line = json.dumps(record, ensure_ascii=False, sort_keys=False, allow_nan=False)
                f.write(line.encode("utf-8") + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def fingerprint(path_or_paths: str | Path | Sequence[str | Path]) -> str:
    """Content fingerprint `sha256:<hex>`, independent of file names and locations.

    One file: the sha256 of its bytes (equal to `sha256sum`). Several files: the sha256
    of their per-file hex digests, one per line, in the order given (so preferences+eval
    differs from eval+preferences).
    """
    if isinstance(path_or_paths, (str, os.PathLike)):
        return "sha256:" + _sha256_file(Path(path_or_paths))
    paths = list(path_or_paths)
    if not paths:
        raise ValueError("fingerprint: no paths given")
    combined = hashlib.sha256()
    for p in paths:
        combined.update(_sha256_file(Path(p)).encode("ascii") + b"\n")
    return "sha256:" + combined.hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
