"""The collect-feedback flow on a real feedback store (SQLite), MLflow (SQLite) and Prefect:
what it exports, what it drops and why, its lineage, and nothing twice."""
from __future__ import annotations

import json
from pathlib import Path

import yaml
from mlflow import MlflowClient

from flows.cli import main as cli_main
from rlhf_core.config import load_config
from rlhf_core.feedback.store import Answer, FeedbackStore, sqlite_url


def served(store, rid, version, answers, prompt="12+34=", user="asker"):
    store.record_response(rid, model_version=version, served_model=f"policy-v{version}", kind="completion",
                          prompt=prompt, user_hash=user, answers_=[Answer(a) for a in answers])


def rolled_back(tracking_uri: str, version_tagged: int) -> None:
    """`policy` versions 1..version_tagged registered, the last one rolled back by an incident."""
    client = MlflowClient(tracking_uri)
    client.create_registered_model("policy")
    for v in range(1, version_tagged + 1):
        client.create_model_version("policy", source="file:///nowhere")
    client.set_model_version_tag("policy", str(version_tagged), "rolled_back_by_incident", "INC-1")


def test_collect_feedback_exports_once_with_lineage_and_says_what_it_dropped(tiny_config, tmp_path, capsys):
    raw = yaml.safe_load(tiny_config.read_text())
    raw["feedback"] = {"settle_s": 0.0, "export_dir": str(tmp_path / "exports"), "min_user_flood": 5}
    raw["serving"] = {"state_dir": str(tmp_path / "serving")}
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(raw))
    cfg = load_config(config)
    rolled_back(cfg.tracking.tracking_uri, 2)

    store = FeedbackStore(sqlite_url(tmp_path / "serving" / "feedback.db"))
    served(store, "choice-1", "1", ["046", "036"])
    store.choose("choice-1", "u1", 0)
    served(store, "up-1", "1", ["057"], prompt="23+34=")
    served(store, "down-1", "1", ["047"], prompt="23+34=")
    store.rate("up-1", "u2", thumb=1)
    store.rate("down-1", "u3", thumb=-1)
    served(store, "v2", "2", ["999"])  # a version since rolled back
    store.rate("v2", "u4", thumb=1)
    served(store, "empty", "1", [""], prompt="11+11=")  # an empty answer: the data contract names it
    served(store, "full", "1", ["022"], prompt="11+11=")
    store.rate("empty", "u5", thumb=1)
    store.rate("full", "u6", thumb=-1)
    for i in range(12):  # one user rating far more than everyone else: capped at min_user_flood (5)
        served(store, f"flood-{i}", "1", [f"{i:03d}"], prompt=f"{i}+0=")
        store.rate(f"flood-{i}", "flood", thumb=1)
    store.close()

    assert cli_main(["collect-feedback", "--config", str(config)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "exported", result
    assert result["dropped"] == {"rolled_back_version": 1, "user_cap": 7, "data_contract": 1}, result
    assert result["pairs"] == 2 and result["served_versions"] == {"1": 10}
    out = Path(result["path"])
    pairs = [json.loads(line) for line in (out / "preferences.jsonl").read_text().splitlines()]
    assert {(p["prompt"], p["chosen"], p["rejected"], p["source"]) for p in pairs} == {
        ("12+34=", "046", "036", "choice"), ("23+34=", "057", "047", "ratings")}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["fingerprint"] == result["fingerprint"] and manifest["version"] == out.name
    assert manifest["capped_users"] == {"flood": 7} and "dropped 7: user_cap" in "\n".join(manifest["report"])
    assert manifest["quality"]["position"]["choices"] == 1
    assert len((out / "ratings.jsonl").read_text().splitlines()) == 4 + 5  # the kept thumbs, unpaired

    run = MlflowClient(cfg.tracking.tracking_uri).get_run(result["run_id"])
    assert run.data.tags["feedback.version"] == out.name and run.data.tags["feedback.served_versions"] == "1"
    assert run.data.metrics["feedback/dropped_user_cap"] == 7
    [dataset] = run.inputs.dataset_inputs
    assert dataset.dataset.name == out.name
    assert json.loads(dataset.dataset.source)["uri"] == str(out / "preferences.jsonl")

    assert cli_main(["collect-feedback", "--config", str(config)]) == 0  # nothing new: nothing exported
    assert json.loads(capsys.readouterr().out) == {"status": "nothing_new", "pairs": 0, "ratings": 0}
    assert [p.name for p in (tmp_path / "exports").iterdir()] == [out.name]
