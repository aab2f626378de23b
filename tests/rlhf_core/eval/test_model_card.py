"""The model card of a registered policy: Hugging Face front matter that parses back, every gate
check with its figures and interval, the regression suites, the settings, the runs, and the
license inherited from the base model."""
from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import yaml

from rlhf_core.config import GateConfig, PolicyConfig
from rlhf_core.eval import model_card
from rlhf_core.eval.checks import fmt
from rlhf_core.eval.confidence import Interval
from rlhf_core.eval.gates import EvalFigures, SuiteFigures, gate
from rlhf_core.eval.model_card import BaseModel, base_model_of, read_license, render_model_card, training_settings
from rlhf_core.eval.regression import RegressionSuite, suite_report


def ci(estimate: float, low: float, high: float) -> Interval:
    return Interval(estimate, low, high, 0.95, 200)


T = GateConfig(min_accuracy_gain=0.05, min_win_rate_vs_reference=0.55, max_kl=5.0,
               regression_suites=[{"name": "no_carry", "path": "demo:no_carry"}])
SUITES = [RegressionSuite("no_carry", Path("runs/x/data/no_carry.jsonl"), "answer_exact_match", 0.05,
                          ["12+34="] * 200, ["46"] * 200)]
REFERENCE = EvalFigures(
    accuracy=0.38, rm_score_mean=-0.5551, win_rate_vs_reference=0.5, win_rate_vs_champion=None,
    kl_to_reference=0.0, mean_length=3.0, reference_mean_length=3.0, degenerate_rate=0.0, generation_failures=0.0,
    audit_score_mean=-0.485, audit_win_rate_vs_reference=0.5, regression=(SuiteFigures("no_carry", 1.0),),
)
CHAMPION = replace(REFERENCE, accuracy=0.9, rm_score_mean=0.41, win_rate_vs_reference=0.74, kl_to_reference=0.31,
                   regression=(SuiteFigures("no_carry", 0.995),))
CANDIDATE = EvalFigures(
    accuracy=0.94, rm_score_mean=0.5377, win_rate_vs_reference=0.7925, win_rate_vs_champion=0.56,
    kl_to_reference=0.3729, mean_length=3.0, reference_mean_length=3.0, degenerate_rate=0.0, generation_failures=0.0,
    audit_score_mean=0.4354, audit_win_rate_vs_reference=0.7675,
    accuracy_gain_vs_reference=ci(0.56, 0.485, 0.6301), accuracy_gain_vs_champion=ci(0.04, 0.01, 0.07),
    win_rate_vs_reference_interval=ci(0.7925, 0.7575, 0.8251), win_rate_vs_champion_interval=ci(0.56, 0.515, 0.605),
    audit_win_rate_vs_reference_interval=ci(0.7675, 0.7299, 0.805), proxy_audit_gap_interval=ci(0.025, 0.005, 0.05),
    regression=(SuiteFigures("no_carry", 0.995, diff_vs_reference=ci(-0.005, -0.015, 0.0),
                             diff_vs_champion=ci(0.0, -0.01, 0.01)),),
)
LINEAGE = {
    "dataset.fingerprint": "sha256:d5787cbe251a1a54c57b5a13586cb43ef12ec691a3b126331c33e396149cd028",
    "base_model.run_id": "5eff5acdb3284d8cb6479a2822da02cd", "reward_model.version": "2",
    "policy.run_id": "3b8c5bc5775f4fae80cfa73f4fb0c440", "algorithm": "grpo",
    "pipeline.run_id": "d550c59401a14aa2a28c8c201cbf0a50",
    "feedback.datasets": "feedback-20261125T213308506115Z", "feedback.served_versions": "3",
}
BASE = BaseModel("org/base-1b", "`org/base-1b`, fine-tuned with SFT by this pipeline.", "apache-2.0",
                 "Inherited from the base model.")


def gate_report(candidate=CANDIDATE, reference=REFERENCE, champion=CHAMPION, thresholds=T, suites=SUITES) -> dict:
    """gate_report.json as `tasks.evaluate._report_json` shapes it, read back from JSON."""
    def policy(f: EvalFigures) -> dict:
        return {"figures": {**asdict(f), "length_ratio": f.length_ratio},
                "length": {"mean": f.mean_length, "p50": 3.0, "p90": 3.0, "max": 4.0}, "failed_prompts": [],
                "samples": [{"prompt": "12+34=", "answer": "46"}]}

    decision = gate(candidate, reference, champion, thresholds)
    assert decision.passed, decision.to_markdown()  # only passing candidates are registered
    report = {
        "decision": decision.to_dict(),
        "thresholds": thresholds.model_dump(mode="json"),
        "num_prompts": 200,
        "candidate": {"model_dir": "runs/x/models/policy", **policy(candidate)},
        "reference": {"model_dir": "runs/x/models/sft", **policy(reference)},
        "champion": None if champion is None else {"version": "3", **policy(champion)},
        "regression_suites": suite_report(suites, candidate, reference, champion),
        "lineage": LINEAGE,
    }
    return json.loads(json.dumps(report, default=str))


def split(card: str) -> tuple[dict, str]:
    """(front matter, Markdown) of a card."""
    assert card.startswith("---\n")
    head, body = card[len("---\n"):].split("\n---\n", 1)
    return yaml.safe_load(head), body


def row(body: str, first_cell: str) -> str:
    [line] = [line for line in body.splitlines() if line.startswith(f"| {first_cell} |")]
    return line


def card(report=None, lineage=LINEAGE, policy=None, base=BASE) -> str:
    settings = training_settings(policy or PolicyConfig())
    return render_model_card(report or gate_report(), lineage, settings, base, eval_run_id="evalrun1")


def test_the_front_matter_parses_back_with_the_hugging_face_keys():
    meta, body = split(card())

    assert meta["license"] == "apache-2.0" and meta["base_model"] == "org/base-1b"
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["tags"] == ["rlhf", "grpo"]
    assert meta["datasets"] == [LINEAGE["dataset.fingerprint"], "feedback-20261125T213308506115Z"]
    assert meta["rlhf"] == {
        "gate": "passed", "dataset_fingerprint": LINEAGE["dataset.fingerprint"],
        "feedback_datasets": ["feedback-20261125T213308506115Z"], "reward_model_version": "2",
        "mlflow": {"policy_run_id": LINEAGE["policy.run_id"], "pipeline_run_id": LINEAGE["pipeline.run_id"],
                   "eval_run_id": "evalrun1", "reference_run_id": LINEAGE["base_model.run_id"]},
    }
    assert body.lstrip().startswith("# policy (GRPO)")


def test_values_that_are_not_plain_yaml_survive_the_front_matter():
    base = BaseModel("/models/my model: v2 #1", "a base.", "other", "Because: reasons.")
    lineage = {**LINEAGE, "dataset.fingerprint": "sha256: '[x]'", "reward_model.version": "10"}
    meta, _ = split(card(lineage=lineage, base=base))
    assert meta["base_model"] == "/models/my model: v2 #1" and meta["license"] == "other"
    assert meta["rlhf"]["dataset_fingerprint"] == "sha256: '[x]'"
    assert meta["rlhf"]["reward_model_version"] == "10"  # a string, as the registry's tag


def test_every_gate_check_is_in_the_card_with_its_figure_threshold_and_interval():
    report = gate_report()
    _, body = split(card(report))
    checks = report["decision"]["checks"]
    assert len(checks) == 12  # ten checks and the suite's two: none skipped in this report

    assert "**Gate: passed ✅**" in body
    assert row(body, "win_rate_vs_reference") == "| win_rate_vs_reference | 0.7925 | [0.7575, 0.8251] | >= 0.55 | ✅ |"
    assert row(body, "regression_vs_reference:no_carry") == \
        "| regression_vs_reference:no_carry | -0.005 | [-0.015, 0] | >= -0.05 | ✅ |"
    assert row(body, "kl_to_reference") == "| kl_to_reference | 0.3729 | – | <= 5 | ✅ |"  # no interval
    for check in checks:
        line = row(body, check["name"])
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == fmt(check["observed"]), line
        assert cells[2] == ("–" if check["low"] is None else f"[{fmt(check['low'])}, {fmt(check['high'])}]"), line
        assert cells[3] == f"{check['op']} {fmt(check['threshold'])}", line
    assert "200 held-out prompts" in body and "`policy` version 3" in body and "95% paired bootstrap" in body
    assert row(body, "candidate (this model)").startswith("| candidate (this model) | 0.94 | 0.7925 | 0.3729 |")
    assert row(body, "champion (v3)").startswith("| champion (v3) | 0.9 | 0.74 | 0.31 |")


def test_the_regression_suites_with_each_policys_accuracy_and_the_intervals():
    _, body = split(card())
    assert row(body, "no_carry") == ("| no_carry | 200 | `answer_exact_match` | 0.05 | 0.995 | 1 | 0.995 | "
                                     "-0.005 [-0.015, 0] | 0 [-0.01, 0.01] |")


def test_a_first_version_without_champion_intervals_or_suites_renders():
    candidate = replace(CANDIDATE, win_rate_vs_champion=None, regression=(), **{
        k: None for k in ("accuracy_gain_vs_reference", "accuracy_gain_vs_champion", "win_rate_vs_reference_interval",
                          "win_rate_vs_champion_interval", "audit_win_rate_vs_reference_interval",
                          "proxy_audit_gap_interval")})
    thresholds = T.model_copy(update={"confidence": None, "regression_suites": []})
    report = gate_report(candidate, replace(REFERENCE, regression=()), None, thresholds, [])
    _, body = split(card(report))

    assert row(body, "win_rate_vs_reference") == "| win_rate_vs_reference | 0.7925 | – | >= 0.55 | ✅ |"
    assert row(body, "accuracy_vs_champion") == "| accuracy_vs_champion | – | – | – | skipped (no champion) |"
    assert "there was no champion yet" in body and "`gates.confidence` is null" in body
    assert "None configured (`gates.regression_suites`)." in body
    assert "champion (v" not in body


def test_the_settings_a_reviewer_needs_are_listed_by_their_config_path():
    _, body = split(card(policy=PolicyConfig(algorithm="grpo", learning_rate=1e-4, steps=30, kl_coef=0.02,
                                            verifiable_reward="addition_exact_match")))
    for path, value in [("policy.algorithm", "grpo"), ("policy.learning_rate", "0.0001"), ("policy.steps", "30"),
                        ("policy.kl_coef", "0.02"), ("policy.grpo.group_size", "8"),
                        ("policy.verifiable_reward", "addition_exact_match")]:
        assert row(body, f"`{path}`") == f"| `{path}` | {value} |"
    assert "policy.lora" not in body and "policy.dpo" not in body


def test_an_offline_method_with_lora_lists_its_own_section_and_the_adapters():
    settings = training_settings(PolicyConfig(algorithm="dpo", lora={"enabled": True, "rank": 4}))
    assert settings["policy.dpo.beta"] == 0.1 and settings["policy.dpo.epochs"] == 2
    assert settings["policy.lora.rank"] == 4 and settings["policy.lora.target_modules"] == "all-linear"
    assert "policy.steps" not in settings and "policy.kl_coef" not in settings  # no rollouts
    meta, _ = split(render_model_card(gate_report(), {**LINEAGE, "algorithm": "dpo"}, settings, BASE))
    assert meta["tags"] == ["rlhf", "dpo", "lora"]


def test_the_runs_data_and_license_are_named_in_the_markdown():
    _, body = split(card())
    for run_id in (LINEAGE["policy.run_id"], LINEAGE["pipeline.run_id"], "evalrun1", LINEAGE["base_model.run_id"]):
        assert f"`{run_id}`" in body
    assert f"runs:/{LINEAGE['policy.run_id']}/model" in body
    assert f"`{LINEAGE['dataset.fingerprint']}`" in body
    assert "`feedback-20261125T213308506115Z` (answers served by policy version 3)" in body
    assert "`reward-model` version 2" in body
    assert "## License\n\n`apache-2.0`. Inherited from the base model." in body


def readme(directory: Path, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "README.md").write_text(text)
    return directory


def test_the_license_is_read_from_a_base_models_readme_front_matter(tmp_path):
    base = readme(tmp_path / "base", "---\nlanguage: en\nlicense: apache-2.0\ntags:\n- text\n---\n\n# Base\n")
    assert read_license(base) == "apache-2.0"
    inherited = base_model_of(str(base), True, "sftrun", [tmp_path / "missing", base])
    assert inherited.license == "apache-2.0" and inherited.name == str(base)
    assert "Inherited from the base model" in inherited.license_note and "sftrun" in inherited.description


@pytest.mark.parametrize("text", [
    None,  # no README
    "# A model\n\nlicense: mit\n",  # no front matter
    "---\nlanguage: en\n---\n",  # no license key
    "---\nlicense: [unclosed\n---\n",  # not YAML
    "---\nlicense: mit\n",  # front matter never closed
])
def test_a_base_model_without_a_readable_license_is_unknown(tmp_path, text):
    base = tmp_path / "base"
    base.mkdir()
    if text is not None:
        readme(base, text)
    assert read_license(base) is None
    unknown = base_model_of(str(base), False, "sftrun", [base])
    assert unknown.license == "unknown" and "names no license" in unknown.license_note
    assert "without SFT" in unknown.description


def test_the_demo_model_trained_from_scratch_carries_the_projects_license_else_other(monkeypatch):
    monkeypatch.setattr(model_card, "project_license", lambda: None)
    demo = base_model_of(None, True, "sftrun")
    assert demo.license == "other" and demo.license_note == model_card.SCRATCH_LICENSE_NOTE
    assert demo.name == "runs:/sftrun/model" and "from scratch" in demo.description

    monkeypatch.setattr(model_card, "project_license", lambda: "MIT")
    assert base_model_of(None, True, "sftrun").license == "MIT"
