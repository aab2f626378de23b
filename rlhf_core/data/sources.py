"""Where a dataset comes from: a file, a `datasets` directory, or a hub name.

    runs/prefs.jsonl          JSONL or Parquet, read by `rlhf_core.data.schema.read_table`
    data/hh                   a directory written by `Dataset.save_to_disk` (or a DatasetDict's,
                              whose `train` split is taken)
    Anthropic/hh-rlhf         a hub dataset, split `train`
    Anthropic/hh-rlhf:test    the same with another split

Every source becomes a DataFrame with a 1-based `_line` column (the row's line in a JSONL
file, its position otherwise), so that errors and reports can point at a row.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from rlhf_core.data.schema import LINE_COLUMN, DataFormatError, read_table

HUB_SPLIT = "train"


def could_exist(spec: str | Path) -> bool:
    """A local file or directory, or a name that may be a hub dataset (org/name[:split])."""
    name = str(spec).partition(":")[0]
    return Path(spec).exists() or (name.count("/") == 1 and not str(spec).startswith((".", "/", "~"))
                                   and not Path(name).suffix)


def read_source(spec: str | Path) -> pd.DataFrame:
    """The rows of `spec` (see the module docstring); raises `DataFormatError` saying what was tried."""
    path = Path(spec)
    if path.is_file():
        return read_table(path)
    if path.is_dir():
        return _with_lines(_load_from_disk(path))
    name, _, split = str(spec).partition(":")
    if "/" not in name or str(spec).startswith((".", "/", "~")):
        raise DataFormatError(f"{spec}: no such file or directory (nor a hub dataset name org/name)")
    return _with_lines(_load_hub(name, split or HUB_SPLIT, str(spec)))


def _with_lines(df: pd.DataFrame) -> pd.DataFrame:
    df = df.drop(columns=[LINE_COLUMN], errors="ignore")
    df[LINE_COLUMN] = range(1, len(df) + 1)
    return df


def _load_from_disk(path: Path) -> pd.DataFrame:
    import datasets  # noqa: PLC0415 - only when a directory is named

    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise DataFormatError(f"{path}: a directory, but not one written by datasets' save_to_disk ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if HUB_SPLIT not in loaded:
            raise DataFormatError(f"{path}: a DatasetDict without a {HUB_SPLIT!r} split (has {', '.join(loaded)})")
        loaded = loaded[HUB_SPLIT]
    return loaded.to_pandas()


def _load_hub(name: str, split: str, spec: str) -> pd.DataFrame:
    import datasets  # noqa: PLC0415

    try:
        return datasets.load_dataset(name, split=split).to_pandas()
    except Exception as exc:  # noqa: BLE001 - the hub's errors are many; the message says which
        raise DataFormatError(f"{spec}: not a local path, and the hub dataset could not be loaded: {exc}") from None
