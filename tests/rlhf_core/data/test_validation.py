"""The preference-data contract: one good dataset, then one bad file per expectation.

Every bad file breaks exactly one rule, and the report must fail exactly that check, name it
and point at the offending line numbers of the file.
"""
from __future__ import annotations

import json
import time

import pandas as pd
import pytest

from rlhf_core.config import ValidationConfig
from rlhf_core.data.schema import read_table, write_jsonl
from rlhf_core.data.validation import ValidationReport, validate_preferences

CFG = ValidationConfig()  # min_rows=100, chars in [1, 4000], duplicate prompt share <= 0.5


def good_rows(n: int = 200) -> list[dict]:
    """`a+b=` prompts, all distinct, chosen the sum and rejected off by one. Row i is line i+1."""
    pairs = [(a, b) for a in range(100) for b in range(10)][:n]
    return [
        {"id": f"p{i}", "prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1), "source": "test"}
        for i, (a, b) in enumerate(pairs)
    ]


def eval_rows() -> list[dict]:
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(500, 510) for b in range(5)]


def validate_file(tmp_path, rows, eval_=None, cfg=CFG, name="prefs.jsonl") -> ValidationReport:
    df = read_table(write_jsonl(rows, tmp_path / name))
    eval_df = read_table(write_jsonl(eval_, tmp_path / "eval.jsonl")) if eval_ is not None else None
    return validate_preferences(df, cfg, eval_df)


def failed_names(report: ValidationReport) -> set[str]:
    return {c.name for c in report.failed}


def test_good_dataset_passes_every_check(tmp_path):
    report = validate_file(tmp_path, good_rows(), eval_rows())
    assert report.success, report.failure_message()
    assert report.num_rows == 200 and report.eval_rows == 50
    assert report.failure_message() == ""
    names = {c.name for c in report.checks}
    assert {
        "row_count",
        "chosen_differs_from_rejected",
        "no_duplicate_pairs",
        "duplicate_prompt_share",
        "no_eval_leakage",
        "eval_answer_not_blank",
    } <= names
    for col in ("prompt", "chosen", "rejected"):
        for kind in ("column_present", "not_null", "is_text", "not_blank", "length_in_range", "decodable"):
            assert f"{col}_{kind}" in names
    assert report.skipped == {}


def test_good_parquet_dataset_passes(tmp_path):
    path = tmp_path / "prefs.parquet"
    pd.DataFrame(good_rows()).to_parquet(path)
    assert validate_preferences(read_table(path), CFG).success


# --- one bad file per expectation ------------------------------------------------------


def null_text(rows):
    rows[3]["chosen"] = None


def blank_text(rows):
    rows[6]["chosen"] = "  \t "
    rows[9]["chosen"] = "\u3000"  # ideographic space: blank too, though RE2's \s is ASCII-only


def too_long(rows):
    rows[16]["rejected"] = "9" * (CFG.max_chars + 1)


def chosen_equals_rejected(rows):
    for i in (3, 16):
        rows[i]["rejected"] = rows[i]["chosen"]


def duplicate_pair(rows):
    rows.append(dict(rows[5], id="copy-of-p5"))


def not_a_string(rows):
    rows[8]["chosen"] = 17


def leaking_prompt(rows):
    rows[12]["prompt"] = eval_rows()[0]["prompt"]
    rows[20]["prompt"] = " " + eval_rows()[3]["prompt"] + " "  # whitespace does not hide a leak


def too_many_duplicate_prompts(rows):
    for i in range(120):  # 119 of 200 rows repeat line 1's prompt; unique rejected keeps triples distinct
        rows[i]["prompt"] = rows[0]["prompt"]
        rows[i]["rejected"] = str(1000 + i)


def too_few_rows(rows):
    del rows[50:]


@pytest.mark.parametrize(
    "corrupt, check, message",
    [
        (null_text, "chosen_not_null", "chosen_not_null: 1 row where chosen is null (line 4)"),
        (blank_text, "chosen_not_blank", "chosen_not_blank: 2 rows where chosen is blank (lines 7, 10)"),
        (
            too_long,
            "rejected_length_in_range",
            "rejected_length_in_range: 1 row where rejected length is outside [1, 4000] chars (line 17)",
        ),
        (
            chosen_equals_rejected,
            "chosen_differs_from_rejected",
            "chosen_differs_from_rejected: 2 rows where chosen == rejected (lines 4, 17)",
        ),
        (
            duplicate_pair,
            "no_duplicate_pairs",
            "no_duplicate_pairs: 2 rows where the (prompt, chosen, rejected) triple is duplicated (lines 6, 201)",
        ),
        (not_a_string, "chosen_is_text", "chosen_is_text: 1 row where chosen is not a string (line 9)"),
        (
            leaking_prompt,
            "no_eval_leakage",
            "no_eval_leakage: 2 rows where the prompt is in the eval set (lines 13, 21)",
        ),
        (
            too_many_duplicate_prompts,
            "duplicate_prompt_share",
            "duplicate_prompt_share: 59.5% of rows repeat an earlier prompt, "
            "expected at most 50.0% of rows repeat an earlier prompt (lines 2, 3, 4,",
        ),
        (too_few_rows, "row_count", "row_count: 50 rows, expected at least 100 rows"),
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
def test_bad_file_fails_exactly_its_check(tmp_path, corrupt, check, message):
    rows = good_rows()
    corrupt(rows)
    report = validate_file(tmp_path, rows, eval_rows())
    assert not report.success
    assert failed_names(report) == {check}, report.failure_message()
    assert report.failure_message().startswith(message), report.failure_message()


def test_missing_column_fails_presence_and_skips_what_needs_it(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "rejected"} for r in good_rows()]
    report = validate_file(tmp_path, rows, eval_rows())
    assert failed_names(report) == {"rejected_column_present"}
    assert report.failure_message() == "rejected_column_present: column 'rejected' is missing"
    for skipped in ("rejected_not_null", "rejected_length_in_range", "chosen_differs_from_rejected", "no_duplicate_pairs"):
        assert skipped in report.skipped
        assert skipped not in {c.name for c in report.checks}
    assert "prompt_not_blank" in {c.name for c in report.checks if c.success}


def test_undecodable_bytes_in_jsonl_fail_decodable(tmp_path):
    path = tmp_path / "prefs.jsonl"
    lines = [json.dumps(r, ensure_ascii=False).encode("utf-8") for r in good_rows()]
    lines[4] = lines[4].replace(b'"chosen": "', b'"chosen": "\xff\xfe')  # raw invalid UTF-8
    path.write_bytes(b"\n".join(lines) + b"\n")
    report = validate_preferences(read_table(path), CFG)
    assert failed_names(report) == {"chosen_decodable"}, report.failure_message()
    assert report.failure_message() == "chosen_decodable: 1 row where chosen has undecodable text (U+FFFD) (line 5)"
    assert report.failed[0].sample[0]["chosen"].startswith("\ufffd\ufffd")


# --- the eval set's own columns --------------------------------------------------------


def test_blank_eval_answer_fails_its_check_with_eval_lines(tmp_path):
    evals = eval_rows()
    evals[2]["answer"] = " "
    report = validate_file(tmp_path, good_rows(), evals)
    assert failed_names(report) == {"eval_answer_not_blank"}
    assert report.failure_message() == "eval_answer_not_blank: 1 row where answer is blank (eval line 3)"


def test_eval_set_without_answer_column(tmp_path):
    evals = [{"prompt": r["prompt"]} for r in eval_rows()]
    report = validate_file(tmp_path, good_rows(), evals)
    assert failed_names(report) == {"eval_answer_column_present"}
    assert "no_eval_leakage" in {c.name for c in report.checks}  # prompts still compared


def test_leakage_check_can_be_disabled(tmp_path):
    rows = good_rows()
    leaking_prompt(rows)
    report = validate_file(tmp_path, rows, eval_rows(), cfg=ValidationConfig(check_eval_leakage=False))
    assert report.success
    assert "no_eval_leakage" in report.skipped


def test_without_eval_set_leakage_is_skipped(tmp_path):
    report = validate_file(tmp_path, good_rows())
    assert report.success and report.eval_rows is None
    assert report.skipped == {"no_eval_leakage": "no eval set given"}


# --- the report --------------------------------------------------------------------------


def test_samples_are_capped_truncated_and_carry_line_numbers(tmp_path):
    rows = good_rows()
    for i in (10, 20, 30, 40):
        rows[i]["chosen"] = "7" * (CFG.max_chars + 1)
    report = validate_file(tmp_path, rows, cfg=ValidationConfig(sample_rows=2))
    (check,) = report.failed
    assert check.name == "chosen_length_in_range" and check.unexpected_count == 4
    assert check.lines == [11, 21, 31, 41]
    assert [s["_line"] for s in check.sample] == [11, 21]
    assert set(check.sample[0]) == {"_line", "prompt", "chosen"}
    assert len(check.sample[0]["chosen"]) <= 80 and check.sample[0]["chosen"].endswith("…")
    assert check.observed == "4 of 200 rows (2.0%)"


def test_many_offending_lines_are_summarised(tmp_path):
    rows = good_rows()
    too_many_duplicate_prompts(rows)
    report = validate_file(tmp_path, rows)
    (check,) = report.failed
    assert check.unexpected_count == 119
    assert report.failure_message().endswith(", … +99 more)")


def test_to_dict_is_json_serialisable(tmp_path):
    rows = good_rows()
    null_text(rows)  # line 4
    rows[16]["rejected"] = rows[16]["chosen"]  # line 17
    report = validate_file(tmp_path, rows, eval_rows())
    data = json.loads(json.dumps(report.to_dict()))
    assert data["success"] is False and data["num_rows"] == 200
    failed = {c["name"]: c for c in data["checks"] if not c["success"]}
    assert set(failed) == {"chosen_not_null", "chosen_differs_from_rejected"}
    assert failed["chosen_not_null"]["sample"] == [{"_line": 4, "prompt": "0+3=", "chosen": None}]
    assert failed["chosen_differs_from_rejected"]["expectation"] == "expect_select_column_values_to_be_unique_within_record"


def test_markdown_has_a_result_table_and_samples_of_failures(tmp_path):
    rows = good_rows()
    chosen_equals_rejected(rows)
    rows[7]["prompt"] = "a | b\nc"  # pipes and newlines must not break the table
    md = validate_file(tmp_path, rows).to_markdown()
    assert "| check | result | expected | observed |" in md
    assert "| `chosen_differs_from_rejected` | ❌ | chosen != rejected in every row | 2 of 200 rows (1.0%) |" in md
    assert "| `row_count` | ✅ | at least 100 rows | 200 rows |" in md
    assert "#### ❌ `chosen_differs_from_rejected`" in md
    assert "| 4 | 0+3= | 3 | 3 |" in md
    assert "| _line | prompt | chosen | rejected |" in md
    assert "no_eval_leakage" in md  # listed as skipped


def test_a_dataframe_without_line_numbers_is_numbered_from_one():
    df = pd.DataFrame(good_rows())
    df.loc[5, "rejected"] = df.loc[5, "chosen"]
    report = validate_preferences(df, CFG)
    assert report.failed[0].lines == [6]


def test_empty_file_fails_presence_and_row_count(tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_bytes(b"")
    report = validate_preferences(read_table(path), CFG)
    assert failed_names(report) == {"prompt_column_present", "chosen_column_present", "rejected_column_present", "row_count"}


def test_five_thousand_rows_validate_quickly(tmp_path):
    rows = [
        {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
        for a in range(500)
        for b in range(10)
    ]
    df = read_table(write_jsonl(rows, tmp_path / "prefs.jsonl"))
    evals = read_table(write_jsonl(eval_rows(), tmp_path / "eval.jsonl"))
    validate_preferences(df.head(10), CFG)  # first call pays GX's one-off imports and registrations
    start = time.perf_counter()
    report = validate_preferences(df, CFG, evals)
    elapsed = time.perf_counter() - start
    assert report.success
    assert elapsed < 10.0, f"validation of 5000 rows took {elapsed:.1f}s"  # ~0.7s when the machine is idle


def test_bom_and_crlf_file_passes_and_the_report_says_how_it_was_read(tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"".join(json.dumps(r).encode() + b"\r\n" for r in good_rows()))
    report = validate_preferences(read_table(path), CFG)
    assert report.success, report.failure_message()
    assert report.num_rows == 200
    assert report.read_notes == ["UTF-8 byte-order mark skipped", "CRLF line ends"]
    assert report.to_dict()["read_notes"] == report.read_notes
    assert "Read with: UTF-8 byte-order mark skipped; CRLF line ends" in report.to_markdown()


def test_extra_columns_are_named_in_the_report_and_not_checked(tmp_path):
    rows = [{**r, "annotator": "a1", "score": None} for r in good_rows()]
    report = validate_file(tmp_path, rows)
    assert report.success, report.failure_message()
    assert report.extra_columns == ["annotator", "score"]  # id and source belong to the contract
    assert report.to_dict()["extra_columns"] == ["annotator", "score"]
    assert "Extra columns, not used in training: `annotator`, `score`" in report.to_markdown()
    assert not any("annotator" in (c.column or "") for c in report.checks)


def test_a_contract_only_file_has_no_extra_columns_or_read_notes(tmp_path):
    report = validate_file(tmp_path, good_rows())
    assert report.extra_columns == [] and report.read_notes == []
