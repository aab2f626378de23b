"""The rlhf-pipeline and validate-data flows under Prefect's test server, with MLflow on SQLite."""
from __future__ import annotations

import asyncio
import json

import pytest
import yaml
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM

from flows.cli import main as cli_main
from flows.pipeline import rlhf_pipeline
from rlhf_core.data.schema import write_jsonl
from tasks.tracking import PipelineFailed

pytestmark = pytest.mark.usefixtures("prefect_server")


def child_runs(client: MlflowClient, parent_id: str) -> dict:
    parent = client.get_run(parent_id)
    runs = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    return {r.info.run_name: r for r in runs}


async def artifact_keys() -> set[str]:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        return {a.key for a in await client.read_artifacts() if a.key}


@pytest.mark.slow
def test_pipeline_runs_every_stage_and_records_lineage(tiny_config, ray_cluster):
    summary = rlhf_pipeline(config_path=str(tiny_config))

    assert summary["status"] == "completed"
    assert summary["stages"]["validate"]["status"] == "passed"
    assert summary["stages"]["validate"]["dataset_fingerprint"].startswith("sha256:")
    assert 0.0 <= summary["stages"]["sft"]["eval_accuracy"] <= 1.0
    on_disk = json.loads(open(summary["summary_path"]).read())
    assert on_disk["status"] == "completed" and on_disk["mlflow_run_id"] == summary["mlflow_run_id"]

    client = MlflowClient(summary["mlflow_tracking_uri"])
    parent = client.get_run(summary["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["dataset.fingerprint"] == summary["stages"]["validate"]["dataset_fingerprint"]
    assert "git.commit" in parent.data.tags and parent.data.params["sft.epochs"] == "1"
    stages = child_runs(client, parent.info.run_id)
    assert set(stages) == {"validate", "sft", "reward", "policy"}
    assert all(r.info.status == "FINISHED" for r in stages.values())
    assert stages["sft"].data.metrics["sft/eval_accuracy"] == summary["stages"]["sft"]["eval_accuracy"]
    assert "sft/loss" in stages["sft"].data.metrics
    logged = {a.path for a in client.list_artifacts(stages["sft"].info.run_id, "model")}
    assert "model/model.safetensors" in logged

    AutoModelForCausalLM.from_pretrained(summary["stages"]["sft"]["model_path"])

    # the reward model is a registered version whose lineage points back at the data and base model
    version = client.get_model_version("reward-model", summary["stages"]["reward"]["registered_version"])
    assert version.run_id == stages["reward"].info.run_id
    assert version.tags["dataset.fingerprint"] == summary["stages"]["validate"]["dataset_fingerprint"]
    assert version.tags["base_model.run_id"] == stages["sft"].info.run_id
    assert "reward/loss" in stages["reward"].data.metrics
    assert stages["reward"].data.metrics["reward/eval_accuracy"] == pytest.approx(summary["stages"]["reward"]["eval_accuracy"], abs=1e-4)
    assert "reward-model-metrics" in asyncio.run(artifact_keys())
    assert_registered_reward_model_scores_like_the_trained_one(client, version, summary)

    # the policy stage ran GRPO against that reward model and logged its before/after figures
    policy = summary["stages"]["policy"]
    assert policy["status"] == "completed" and policy["algorithm"] == "grpo" and policy["steps"] == 2
    assert stages["policy"].data.tags["reward_model.version"] == summary["stages"]["reward"]["registered_version"]
    assert stages["policy"].data.metrics["policy/accuracy_after"] == policy["accuracy_after"]
    assert "eval/accuracy" in stages["policy"].data.metrics and "rollout/logprob_diff" in stages["policy"].data.metrics
    assert "model/model.safetensors" in {a.path for a in client.list_artifacts(stages["policy"].info.run_id, "model")}
    AutoModelForCausalLM.from_pretrained(policy["model_path"])


def test_validation_report_is_a_prefect_artifact(tiny_config, tmp_path, capsys):
    from rlhf_core.config import DemoDataConfig
    from rlhf_core.data.synthetic import generate_demo_data

    files = generate_demo_data(DemoDataConfig(n_sft=10, n_pairs=300, n_eval=20), tmp_path / "d")
    assert cli_main(["validate", str(files.preferences), "--config", str(tiny_config)]) == 0
    assert "data-validation-report" in asyncio.run(artifact_keys())


def assert_registered_reward_model_scores_like_the_trained_one(client, version, summary):
    import mlflow
    import torch

    from rlhf_core.data.schema import read_table
    from rlhf_core.models.reward import load_reward_model, score

    mlflow.set_tracking_uri(summary["mlflow_tracking_uri"])
    downloaded = mlflow.artifacts.download_artifacts(f"models:/reward-model/{version.version}")
    pairs = read_table(summary["output_dir"] + "/data/preferences.jsonl").head(16)
    prompts, chosen = list(pairs["prompt"]), list(pairs["chosen"])
    scores = []
    for path in (summary["stages"]["reward"]["model_path"], downloaded):
        model, tokenizer, stats = load_reward_model(path)
        scores.append((score(model, tokenizer, prompts, chosen, max_length=32), stats))
    torch.testing.assert_close(scores[0][0], scores[1][0], rtol=0, atol=0)
    assert scores[0][1] == scores[1][1]  # normalisation statistics travel with the model


def bad_preferences(tmp_path):
    rows = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(150)]
    rows[4]["rejected"] = rows[4]["chosen"]
    rows[17]["rejected"] = rows[17]["chosen"]
    return write_jsonl(rows, tmp_path / "bad.jsonl")


def test_bad_data_stops_the_pipeline_before_training(tiny_config, tmp_path):
    raw = yaml.safe_load(tiny_config.read_text())
    raw["data"] = {"preferences_path": str(bad_preferences(tmp_path))}
    tiny_config.write_text(yaml.safe_dump(raw))

    with pytest.raises(PipelineFailed) as exc:
        rlhf_pipeline(config_path=str(tiny_config))
    summary = exc.value.summary
    assert summary["status"] == "failed" and summary["failed_stage"] == "validate"
    assert "chosen_differs_from_rejected" in summary["error"] and "5" in summary["error"]
    assert "sft" not in summary["stages"]
    assert json.loads(open(summary["summary_path"]).read())["status"] == "failed"

    client = MlflowClient(summary["mlflow_tracking_uri"])
    assert client.get_run(summary["mlflow_run_id"]).info.status == "FAILED"
    stages = child_runs(client, summary["mlflow_run_id"])
    assert set(stages) == {"validate"}
    assert stages["validate"].info.status == "FAILED"
    assert stages["validate"].data.tags["validation.verdict"] == "failed"
    kept = {a.path for a in client.list_artifacts(stages["validate"].info.run_id)}
    assert "validation_report.json" in kept


def test_cli_validate_exits_nonzero_naming_the_problem(tiny_config, tmp_path, capsys):
    code = cli_main(["validate", str(bad_preferences(tmp_path)), "--config", str(tiny_config)])
    out = capsys.readouterr()
    assert code == 1
    assert "chosen_differs_from_rejected" in out.out + out.err
    assert "FAILED" in out.out
