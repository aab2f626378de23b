"""The preference-data file contract: reading, writing, fingerprints."""
from __future__ import annotations

import hashlib
import json

import pandas as pd
import pytest

from rlhf_core.data.schema import (
    LINE_COLUMN,
    READ_NOTES,
    PREFERENCE_COLUMNS,
    DataFormatError,
    fingerprint,
    read_table,
    write_jsonl,
)

ROWS = [
    {"id": "p0", "prompt": "1+2=", "chosen": "3", "rejected": "4", "source": "test"},
    {"id": "p1", "prompt": "15+17=", "chosen": "32", "rejected": "22", "source": "test"},
    {"id": "p2", "prompt": "café+1=", "chosen": "é", "rejected": "e", "source": "test"},
]


def test_jsonl_roundtrip_keeps_values_and_line_numbers(tmp_path):
    path = write_jsonl(ROWS, tmp_path / "prefs.jsonl")
    df = read_table(path)
    assert df[LINE_COLUMN].tolist() == [1, 2, 3]
    assert df.drop(columns=LINE_COLUMN).to_dict("records") == ROWS
    assert set(PREFERENCE_COLUMNS) <= set(df.columns)


def test_jsonl_blank_lines_are_skipped_but_line_numbers_stay_true(tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n  \n" + json.dumps(ROWS[1]) + "\n")
    df = read_table(path)
    assert df[LINE_COLUMN].tolist() == [1, 4]
    assert df["prompt"].tolist() == ["1+2=", "15+17="]


def test_jsonl_missing_keys_become_nulls(tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_text('{"prompt": "1+2=", "chosen": "3"}\n{"prompt": "2+2=", "chosen": "4", "rejected": "5"}\n')
    df = read_table(path)
    assert df["rejected"].isna().tolist() == [True, False]


def test_parquet_is_read_with_row_numbers(tmp_path):
    path = tmp_path / "prefs.parquet"
    pd.DataFrame(ROWS).to_parquet(path)
    df = read_table(path)
    assert df[LINE_COLUMN].tolist() == [1, 2, 3]
    assert df.drop(columns=LINE_COLUMN).to_dict("records") == ROWS


@pytest.mark.parametrize("bad_line", ["{not json", "[1, 2, 3]", '"a string"', "42"])
def test_bad_jsonl_line_names_file_and_line(tmp_path, bad_line):
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n" + bad_line + "\n")
    with pytest.raises(DataFormatError, match=r"prefs\.jsonl:3: "):
        read_table(path)


def test_unknown_suffix_is_a_format_error(tmp_path):
    path = tmp_path / "prefs.csv"
    path.write_text("prompt,chosen,rejected\n")
    with pytest.raises(DataFormatError, match="unknown file type '.csv'"):
        read_table(path)


def test_undecodable_bytes_become_replacement_chars_not_a_crash(tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_bytes(b'{"prompt": "1+2=", "chosen": "3\xff\xfe", "rejected": "4"}\n')
    df = read_table(path)
    assert df.loc[0, "chosen"] == "3\ufffd\ufffd"


def test_lone_surrogate_escapes_become_replacement_chars(tmp_path):
    # valid JSON, but not encodable text: Arrow-backed pandas strings would refuse it
    path = tmp_path / "prefs.jsonl"
    path.write_text('{"prompt": "1+2=", "chosen": "3\\ud800", "rejected": "4"}\n')
    assert read_table(path).loc[0, "chosen"] == "3\ufffd"


def test_write_jsonl_bytes_are_exact_and_deterministic(tmp_path):
    rows = [{"prompt": "café", "chosen": "é", "rejected": "e", LINE_COLUMN: 7}]
    a = write_jsonl(rows, tmp_path / "a.jsonl").read_bytes()
    b = write_jsonl(rows, tmp_path / "b.jsonl").read_bytes()
    assert a == b == '{"prompt": "café", "chosen": "é", "rejected": "e"}\n'.encode("utf-8")


def test_write_read_write_is_byte_identical(tmp_path):
    first = write_jsonl(ROWS, tmp_path / "first.jsonl")
    again = write_jsonl(read_table(first).to_dict("records"), tmp_path / "again.jsonl")
    assert first.read_bytes() == again.read_bytes()


def test_write_jsonl_is_atomic_on_failure(tmp_path):
    path = write_jsonl(ROWS, tmp_path / "prefs.jsonl")
    before = path.read_bytes()
    bad_rows = ROWS + [{"prompt": "1+1=", "chosen": float("nan"), "rejected": "3"}]  # NaN is not JSON
    with pytest.raises(ValueError):
        write_jsonl(bad_rows, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefs.jsonl"]  # no temp file left


def test_write_jsonl_leaves_no_temp_files_and_creates_parents(tmp_path):
    path = write_jsonl(ROWS, tmp_path / "nested" / "dir" / "prefs.jsonl")
    assert [p.name for p in path.parent.iterdir()] == ["prefs.jsonl"]


def test_fingerprint_is_sha256_of_content(tmp_path):
    path = write_jsonl(ROWS, tmp_path / "prefs.jsonl")
    assert fingerprint(path) == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    assert fingerprint(str(path)) == fingerprint(path)


def test_fingerprint_is_stable_across_rename_and_changes_with_content(tmp_path):
    path = write_jsonl(ROWS, tmp_path / "prefs.jsonl")
    before = fingerprint(path)
    renamed = path.rename(tmp_path / "renamed.jsonl")
    assert fingerprint(renamed) == before
    write_jsonl(ROWS[:2], renamed)
    assert fingerprint(renamed) != before


def test_fingerprint_of_several_files_depends_on_each_and_on_order(tmp_path):
    prefs = write_jsonl(ROWS, tmp_path / "prefs.jsonl")
    evals = write_jsonl([{"prompt": "2+2=", "answer": "4"}], tmp_path / "eval.jsonl")
    both = fingerprint([prefs, evals])
    assert both.startswith("sha256:") and len(both) == len("sha256:") + 64
    assert both != fingerprint(prefs)
    assert both != fingerprint([evals, prefs])
    evals.rename(tmp_path / "eval-renamed.jsonl")
    assert fingerprint([prefs, tmp_path / "eval-renamed.jsonl"]) == both


def test_bom_and_crlf_jsonl_is_read_and_says_so(tmp_path):
    """What Windows tools write: a UTF-8 byte-order mark, then CRLF line ends."""
    path = tmp_path / "prefs.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\r\n" for r in ROWS))
    df = read_table(path)
    assert df.drop(columns=LINE_COLUMN).to_dict("records") == ROWS
    assert df[LINE_COLUMN].tolist() == [1, 2, 3]
    assert df.attrs[READ_NOTES] == ["UTF-8 byte-order mark skipped", "CRLF line ends"]


def test_plain_jsonl_has_no_read_notes(tmp_path):
    assert read_table(write_jsonl(ROWS, tmp_path / "prefs.jsonl")).attrs[READ_NOTES] == []


def test_a_byte_order_mark_after_the_first_line_is_still_bad_json(tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode() + b"\n\xef\xbb\xbf" + json.dumps(ROWS[1]).encode() + b"\n")
    with pytest.raises(DataFormatError, match=r"prefs.jsonl:2: not valid JSON"):
        read_table(path)
