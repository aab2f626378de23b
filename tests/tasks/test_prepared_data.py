"""The prepared data is read once and split once, and every stage sees the same split."""
from __future__ import annotations

import json

import tasks.data_contract as data_contract
from rlhf_core.data.pairs import split_by_prompt
from tasks.data_contract import DataPaths, PreparedData, ValidatedData

PAIRS = [{"prompt": f"q{i % 7}", "chosen": f"good {i}", "rejected": f"bad {i}", "source": "x"} for i in range(40)]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _counting_reads(monkeypatch):
    reads = []
    real = data_contract.read_table

    def read_table(path, *args, **kwargs):
        reads.append(path.name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(data_contract, "read_table", read_table)
    return reads


def test_the_preferences_are_read_once_and_the_held_out_prompts_are_the_reward_models(tmp_path, monkeypatch):
    reads = _counting_reads(monkeypatch)
    paths = DataPaths(_write(tmp_path / "prefs.jsonl", PAIRS), None, None, generated=False)
    data = ValidatedData(paths, 0.25, 3, "sha256:x", len(PAIRS), tmp_path / "report.json")

    train, held_out = data.split
    expected = split_by_prompt([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in PAIRS], 0.25, 3)
    assert (train, held_out) == expected
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in held_out})
    prompts, answers = data.eval_set
    assert prompts == list(dict.fromkeys(r["prompt"] for r in held_out)) and answers is None
    assert data.pairs[0] == {"prompt": "q0", "chosen": "good 0", "rejected": "bad 0"}  # only the pair's columns
    data.split, data.eval_set, data.pairs  # noqa: B018 - asked again
    assert reads == ["prefs.jsonl"]


def test_an_eval_file_is_the_eval_set_with_its_answers(tmp_path, monkeypatch):
    reads = _counting_reads(monkeypatch)
    evals = _write(tmp_path / "eval.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}])
    data = PreparedData(DataPaths(_write(tmp_path / "prefs.jsonl", PAIRS), evals, None, generated=False), 0.25, 3)
    assert data.eval_set == (["1+1=", "2+2="], ["2", "4"])
    assert data.eval_set is data.eval_set and reads == ["eval.jsonl"]  # no preference read needed
