"""The rlhf-pipeline and validate-data flows under Prefect's test server, with MLflow on SQLite."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM

from flows.cli import main as cli_main
from flows.pipeline import rlhf_pipeline
from rlhf_core.data.schema import read_table, write_jsonl
from tasks.summary import PipelineFailed

pytestmark = pytest.mark.usefixtures("prefect_server")


def child_runs(client: MlflowClient, parent_id: str) -> dict:
    parent = client.get_run(parent_id)
    runs = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    return {r.info.run_name: r for r in runs}


async def artifact_keys() -> set[str]:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        return {a.key for a in await client.read_artifacts() if a.key}


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def deployed(prefect_server):
    """prefect.yaml deployed with `prefect deploy --all` to the test's Prefect server, and a
    process worker of the `rlhf-local` pool polling it every second; stopped at the end."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "RLHF_HOME": str(REPO),
           "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1"}
    prefect = str(Path(sys.executable).parent / "prefect")
    for cmd in ([prefect, "work-pool", "create", "rlhf-local", "--type", "process", "--overwrite"],
                [prefect, "deploy", "--all", "--no-prompt"]):
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{cmd}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    worker = subprocess.Popen([prefect, "worker", "start", "--pool", "rlhf-local"], cwd=REPO, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield
    finally:
        # SIGTERM first; a worker still retrying calls to a busy SQLite server may not stop
        # in time (seen once in CI: "database is locked" on the server, the worker still up
        # 60 s later), and the tests are over by then: kill its process group.
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(30)


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.fixture(scope="module")
def full_run(deployed, tmp_path_factory, tiny_config_factory, free_ports):
    """One run of the `rlhf-pipeline/nightly` deployment on configs/demo.yaml (with overrides
    that make it test-sized), started through the Prefect API and executed by the process worker, through every stage, serving included (gates loose: a
    2-step tiny policy cannot be expected to beat its SFT policy; the gate math has its own
    tests). Whatever it serves is stopped at the end of the module."""
    from prefect.deployments import run_deployment

    from rlhf_core.config import load_config
    from rlhf_core.serving import server

    tmp = tmp_path_factory.mktemp("full")
    raw = tiny_config_factory(tmp)
    raw["reward"]["num_workers"] = 2  # the demo's stage as it runs, distributed
    raw["gates"].update({"auto_promote": True, "min_accuracy_gain": -1.0, "min_win_rate_vs_reference": 0.0,
                    "min_win_rate_vs_champion": 0.0, "max_regression_vs_champion": 1.0, "max_length_ratio": 100.0,
                    "max_degenerate_rate": 1.0, "max_kl": 1000.0})
    raw["serving"] = {"ports": free_ports(2), "smoke_prompt": "12+34="}
    config = tmp / "full.yaml"  # the same settings as a file, for the commands the later tests run
    config.write_text(yaml.safe_dump(raw))
    cfg = load_config(config)
    state_dir = server.state_dir_for(cfg.serving, cfg.output_dir)
    # the deployment runs the demo config as a user would start it from the UI, made small by overrides
    overrides = [f"{key}={json.dumps(value)}" for key, value in flat(raw).items()]
    assert load_config(REPO / "configs" / "demo.yaml", overrides) == cfg
    try:
        flow_run = run_deployment("rlhf-pipeline/nightly", timeout=1200, poll_interval=2,
                                  parameters={"config_path": "configs/demo.yaml", "overrides": overrides})
        [summary_path] = (tmp / "runs").glob("*/summary.json")
        summary = json.loads(summary_path.read_text())
        assert flow_run.state.is_completed(), (flow_run.state, summary.get("error"))
        yield config, cfg, state_dir, summary
    finally:
        server.stop(state_dir)


@pytest.mark.slow
def test_the_nightly_deployment_is_scheduled_and_every_deployment_has_a_form(deployed):
    from prefect import get_client

    with get_client(sync_client=True) as client:
        nightly = client.read_deployment_by_name("rlhf-pipeline/nightly")
        [schedule] = nightly.schedules
        assert schedule.schedule.cron == "0 2 * * *" and schedule.active
        assert nightly.parameters == {"config_path": "configs/demo.yaml", "overrides": []}
        assert nightly.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
        [collect] = client.read_deployment_by_name("collect-feedback/collect-feedback").schedules
        assert collect.schedule.cron == "30 1 * * *" and collect.active  # before the nightly run
        for name in ("rlhf-pipeline/nightly", "evaluate/evaluate", "deploy-champion/deploy-champion",
                     "rollback/rollback", "collect-feedback/collect-feedback"):
            deployment = client.read_deployment_by_name(name)
            assert deployment.work_pool_name == "rlhf-local"
            properties = deployment.parameter_openapi_schema["properties"]
            assert properties and all(p.get("description") for p in properties.values()), (name, properties)


@pytest.mark.slow
def test_pipeline_runs_every_stage_and_records_lineage(full_run, tmp_path):
    _, _, _, summary = full_run

    assert summary["status"] == "completed"
    # the data stage and the data contract are two records: the first's notes reach summary.json
    assert summary["stages"]["data"]["status"] == "prepared" and "notes" in summary["stages"]["data"]
    assert summary["stages"]["validate"]["status"] == "passed"
    assert summary["stages"]["validate"]["dataset_fingerprint"].startswith("sha256:")
    n_eval = len(read_table(Path(summary["output_dir"]) / "data" / "eval.jsonl"))
    correct = summary["stages"]["sft"]["eval_accuracy"] * n_eval  # exact matches among every eval prompt
    assert n_eval == 24 and 0 <= round(correct) <= n_eval and abs(correct - round(correct)) < 1e-9
    on_disk = json.loads(open(summary["summary_path"]).read())
    assert on_disk["status"] == "completed" and on_disk["mlflow_run_id"] == summary["mlflow_run_id"]

    client = MlflowClient(summary["mlflow_tracking_uri"])
    parent = client.get_run(summary["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["dataset.fingerprint"] == summary["stages"]["validate"]["dataset_fingerprint"]
    assert "git.commit" in parent.data.tags and parent.data.params["sft.epochs"] == "1"
    stages = child_runs(client, parent.info.run_id)
    assert set(stages) == {"validate", "sft", "reward", "policy", "evaluate"}
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
    assert_registered_reward_model_scores_like_the_trained_one(client, version, summary, tmp_path)

    # the policy stage ran GRPO against that reward model and logged its before/after figures
    policy = summary["stages"]["policy"]
    assert policy["status"] == "completed" and policy["algorithm"] == "grpo" and policy["steps"] == 2
    assert stages["policy"].data.tags["reward_model.version"] == summary["stages"]["reward"]["registered_version"]
    assert stages["policy"].data.metrics["policy/accuracy_after"] == policy["accuracy_after"]
    assert "eval/accuracy" in stages["policy"].data.metrics and "rollout/logprob_diff" in stages["policy"].data.metrics
    assert "model/model.safetensors" in {a.path for a in client.list_artifacts(stages["policy"].info.run_id, "model")}
    AutoModelForCausalLM.from_pretrained(policy["model_path"])


@pytest.mark.slow
def test_gates_register_promote_and_deploy_the_candidate(full_run):
    from rlhf_core.serving import server

    _, cfg, state_dir, summary = full_run
    client = MlflowClient(summary["mlflow_tracking_uri"])
    stages = child_runs(client, summary["mlflow_run_id"])

    # the gate decision: MLflow metrics and tags, a JSON report, a Prefect table artifact
    evaluation = summary["stages"]["evaluate"]
    assert evaluation["status"] == "passed" and evaluation["champion"] is None
    gate_run = stages["evaluate"].data
    assert gate_run.metrics["gate/passed"] == 1.0 and gate_run.tags["gate.passed"] == "true"
    assert gate_run.metrics["eval/reference/kl_to_reference"] == 0.0
    assert gate_run.metrics["eval/candidate/win_rate_vs_reference"] == evaluation["win_rate_vs_reference"] or \
        abs(gate_run.metrics["eval/candidate/win_rate_vs_reference"] - evaluation["win_rate_vs_reference"]) < 1e-3
    report = json.loads(open(evaluation["report"]).read())
    assert report["decision"]["passed"] is True and len(report["decision"]["checks"]) == 10
    assert report["candidate"]["figures"]["accuracy"] == evaluation["accuracy"]
    assert {"gate-decision", "deployed-endpoint", "policy-metrics"} <= asyncio.run(artifact_keys())

    # the registry: version 1 of `policy` with lineage, promoted (auto_promote) with no previous champion
    register = summary["stages"]["register"]
    assert register == {"status": "promoted", "version": "1", "aliases": ["champion"], "previous_champion": None}
    v1 = client.get_model_version_by_alias("policy", "champion")
    assert str(v1.version) == "1" and v1.run_id == stages["policy"].info.run_id
    assert v1.tags["dataset.fingerprint"] == summary["stages"]["validate"]["dataset_fingerprint"]
    assert v1.tags["reward_model.version"] == summary["stages"]["reward"]["registered_version"]
    assert v1.tags["base_model.run_id"] == stages["sft"].info.run_id and v1.tags["gate.passed"] == "true"
    assert v1.tags["promoted_by"] == f"pipeline:{summary['mlflow_run_id']}"

    # deployment: the served model is v1, behind an API key
    deploy = summary["stages"]["deploy"]
    assert deploy["status"] == "serving" and deploy["version"] == "1"
    current = server.current_endpoint(state_dir)
    assert current.url == deploy["endpoint"] and current.url.startswith("http://127.0.0.1:")
    key = server.resolve_api_key(cfg.serving, state_dir)
    assert server.list_models(current.url, key) == ["policy-v1"]
    assert isinstance(server.complete(current.url, key, "policy-v1", "12+34=", max_tokens=4), str)
    for bad_key in (None, "wrong"):
        with pytest.raises(server.ServingError, match="401"):
            server.complete(current.url, bad_key, "policy-v1", "12+34=")


@pytest.mark.slow
def test_the_registered_version_carries_its_model_card_and_loads_with_plain_transformers(full_run, tmp_path):
    import mlflow

    _, _, _, summary = full_run
    uri, version = summary["mlflow_tracking_uri"], summary["stages"]["register"]["version"]
    client = MlflowClient(uri, registry_uri=uri)
    source = client.get_model_version_download_uri("policy", version)
    model_dir = Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(tmp_path), tracking_uri=uri))

    # the card: Hugging Face front matter, and the gate's figures as the report has them
    card = (model_dir / "README.md").read_text()
    head, body = card.removeprefix("---\n").split("\n---\n", 1)
    meta = yaml.safe_load(head)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation", card
    assert meta["license"] == "other" and meta["tags"] == ["rlhf", "grpo"]  # the demo's model, from scratch
    assert meta["datasets"] == [summary["stages"]["validate"]["dataset_fingerprint"]]
    stages = child_runs(client, summary["mlflow_run_id"])
    assert meta["rlhf"]["mlflow"]["policy_run_id"] == stages["policy"].info.run_id
    assert meta["rlhf"]["mlflow"]["pipeline_run_id"] == summary["mlflow_run_id"]
    report = json.loads(open(summary["stages"]["evaluate"]["report"]).read())
    for check in report["decision"]["checks"]:
        assert f"| {check['name']} |" in body, card
    [wins] = [c for c in report["decision"]["checks"] if c["name"] == "win_rate_vs_reference"]
    interval = "–" if wins["low"] is None else f"[{wins['low']:.4g}, {wins['high']:.4g}]"
    assert f"| win_rate_vs_reference | {wins['observed']:.4g} | {interval} |" in body, card

    # the directory is a plain transformers model: no custom code, loads without this project
    assert "auto_map" not in json.loads((model_dir / "config.json").read_text())
    code = (
        "import sys\n"
        "sys.modules['rlhf_core'] = sys.modules['tasks'] = sys.modules['flows'] = None\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"d = {str(model_dir)!r}\n"
        "tokenizer, model = AutoTokenizer.from_pretrained(d), AutoModelForCausalLM.from_pretrained(d)\n"
        "inputs = tokenizer('12+34=', return_tensors='pt')\n"
        "out = model.generate(**inputs, max_new_tokens=4, do_sample=False)\n"
        "print('generated', out.shape[1] - inputs['input_ids'].shape[1])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split("generated")[-1]) >= 1, done.stdout


def test_validation_report_is_a_prefect_artifact(tiny_config, tmp_path, capsys):
    from rlhf_core.config import DemoDataConfig
    from rlhf_core.data.synthetic import generate_demo_data

    files = generate_demo_data(DemoDataConfig(n_sft=10, n_pairs=300, n_eval=20), tmp_path / "d")
    assert cli_main(["validate", "--record", str(files.preferences), "--config", str(tiny_config)]) == 0
    assert "data-validation-report" in asyncio.run(artifact_keys())


def assert_registered_reward_model_scores_like_the_trained_one(client, version, summary, tmp: Path):
    import mlflow
    import torch

    from rlhf_core.data.schema import read_table
    from rlhf_core.models.reward import load_reward_model, score

    mlflow.set_tracking_uri(summary["mlflow_tracking_uri"])
    downloaded = mlflow.artifacts.download_artifacts(f"models:/reward-model/{version.version}",
                                                     dst_path=str(tmp / "registered-reward-model"))  # not /tmp
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


def register_copy(client, summary, model_dir, tags) -> str:
    """A new `policy` version from `model_dir`, logged to a fresh run (as a later pipeline would)."""
    from tasks.registry import register_model_version

    parent = client.get_run(summary["mlflow_run_id"])
    run = client.create_run(parent.info.experiment_id, run_name="policy-copy")
    client.log_artifacts(run.info.run_id, str(model_dir), "model")
    client.set_terminated(run.info.run_id)
    return register_model_version(client, "policy", run.info.run_id, "model", tags)


def served(cfg, state_dir) -> tuple[list[str], int]:
    """What the recorded endpoint serves, asked through the API, and the server's pid."""
    from rlhf_core.serving import server

    current = server.current_endpoint(state_dir)
    return server.list_models(current.url, server.resolve_api_key(cfg.serving, state_dir)), current.pid


@pytest.mark.slow
def test_promote_deploy_rollback_and_a_broken_deploy(full_run, tmp_path, capsys):
    import shutil

    from tasks.registry import incident_record

    config, cfg, state_dir, summary = full_run
    client = MlflowClient(summary["mlflow_tracking_uri"])
    v1 = client.get_model_version("policy", "1")
    tags = {k: v for k, v in v1.tags.items() if k in ("dataset.fingerprint", "base_model.run_id", "reward_model.version")}
    v2 = register_copy(client, summary, summary["stages"]["policy"]["model_path"], {**tags, "gate.passed": "true"})

    # a person promotes v2 and deploys it: blue/green onto the other port, v1's server stops
    assert cli_main(["promote", v2, "--by", "alice", "--reason", "weekly run", "--deploy", "--config", str(config)]) == 0
    assert f"policy v{v2} is now the champion (previous: v1)" in capsys.readouterr().out
    assert served(cfg, state_dir)[0] == [f"policy-v{v2}"]
    assert client.get_model_version("policy", v2).tags["previous_champion"] == "1"

    # on-call rolls back: champion v1 again, served again, recorded once per incident
    args = ["rollback", "--incident", "INC-7", "--reason", "KL explosion", "--by", "bob", "--config", str(config)]
    assert cli_main(args) == 0
    assert str(client.get_model_version_by_alias("policy", "champion").version) == "1"
    models, pid = served(cfg, state_dir)
    assert models == ["policy-v1"]
    record = incident_record(client, "INC-7")
    assert record["status"] == "completed" and record["from"] == v2 and record["to"] == "1"
    assert record["requested_by"] == "bob" and record["reason"] == "KL explosion"
    assert client.get_model_version("policy", "1").tags["rollback.incident"] == "INC-7"
    assert "rollback" in asyncio.run(artifact_keys())
    rollback_runs = client.search_runs([client.get_run(summary["mlflow_run_id"]).info.experiment_id],
                                       "tags.incident = 'INC-7'")
    assert len(rollback_runs) == 1 and rollback_runs[0].data.tags["rollback.requested_by"] == "bob"

    capsys.readouterr()
    assert cli_main(args) == 0  # the same incident again: nothing happens
    assert '"action": "none"' in capsys.readouterr().out
    assert served(cfg, state_dir) == (["policy-v1"], pid)
    assert len(client.search_runs([rollback_runs[0].info.experiment_id], "tags.incident = 'INC-7'")) == 1

    # a broken model (corrupt weights) is promoted: its deploy is refused before a server starts
    # and v1 keeps serving
    broken = tmp_path / "broken"
    shutil.copytree(summary["stages"]["policy"]["model_path"], broken)
    (broken / "model.safetensors").write_bytes(b"\x00garbage" * 1000)
    v3 = register_copy(client, summary, broken, {**tags, "gate.passed": "true"})
    capsys.readouterr()
    assert cli_main(["promote", v3, "--deploy", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and f"policy-v{v3} refused, no server started" in err and "cannot be read" in err
    assert served(cfg, state_dir) == (["policy-v1"], pid)  # the old server, untouched

    # and rolling back from the broken champion returns to v1 without restarting it
    assert cli_main(["rollback", "--incident", "INC-8", "--reason", "broken deploy", "--config", str(config)]) == 0
    assert str(client.get_model_version_by_alias("policy", "champion").version) == "1"
    assert served(cfg, state_dir) == (["policy-v1"], pid)


@pytest.mark.slow
def test_evaluate_flow_rejects_with_reasons_and_promote_then_refuses(full_run, capsys):
    config, _, _, summary = full_run
    client = MlflowClient(summary["mlflow_tracking_uri"])
    v1 = client.get_model_version("policy", "1")
    tags = {k: v for k, v in v1.tags.items() if k in ("dataset.fingerprint", "base_model.run_id", "reward_model.version")}
    candidate = register_copy(client, summary, summary["stages"]["policy"]["model_path"], tags)
    champion_before = str(client.get_model_version_by_alias("policy", "champion").version)

    code = cli_main(["evaluate", candidate, "--config", str(config), "--set", "gates.max_kl=0.000001",
                     "--set", "gates.min_accuracy_gain=1.0"])
    out = capsys.readouterr().out
    assert code == 3 and "evaluate: REJECTED" in out
    tags = client.get_model_version("policy", candidate).tags
    assert tags["gate.passed"] == "false" and tags["gate.vs_champion"] == champion_before
    assert "accuracy_below_reference" in tags["gate.reasons"] and "kl_above_max" in tags["gate.reasons"]

    assert cli_main(["promote", candidate, "--config", str(config)]) == 1
    assert f"the gates did not pass policy v{candidate} (rejected: " in capsys.readouterr().err
    assert str(client.get_model_version_by_alias("policy", "champion").version) == champion_before


@pytest.mark.slow
def test_feedback_on_served_answers_trains_the_next_policy(full_run, free_ports):
    """The loop: the champion serves through the gateway; simulated users chat and rate through
    the `openai` client; the collect-feedback deployment exports their feedback; the nightly
    deployment trains on base data plus feedback, and the new version's lineage names the
    feedback dataset and the version that was rated. This nightly run uses KTO with LoRA
    adapters instead of GRPO (as a team comparing methods on its own data would): it learns from
    the feedback's pairs and from its thumbs, the answers rated up or down alone; the same
    validation, gates, registry and serving take its policy, merged, and vLLM serves it."""
    from prefect.deployments import run_deployment

    from rlhf_core.feedback.simulated_users import UsersConfig, simulate
    from rlhf_core.serving import server
    from rlhf_core.serving.user_auth import USER_SECRET_FILE, resolve_secret
    from rlhf_core.testing.gateway_process import running_gateway

    config, cfg, state_dir, summary = full_run
    client = MlflowClient(summary["mlflow_tracking_uri"])
    rated = str(client.get_model_version_by_alias("policy", "champion").version)
    assert served(cfg, state_dir)[0] == [f"policy-v{rated}"]
    eval_prompts = list(read_table(Path(summary["output_dir"]) / "data" / "eval.jsonl")["prompt"])
    port = free_ports(1)[0]
    with running_gateway(["--config", str(config), "--set", f"feedback.port={port}"], port) as gateway:
        key = server.resolve_api_key(cfg.serving, state_dir)
        # the user-signing secret as the gateway resolved it: its variable, else the state dir's file
        user_secret = resolve_secret(cfg.feedback.user_secret_env, state_dir / USER_SECRET_FILE)
        # a 2-step tiny policy answers mostly garbage: users choose between two answers, where
        # "closer to the right sum" still decides, so that there are pairs to train on
        users = UsersConfig(users=8, requests_per_user=12, choice_share=0.8, label_noise=0.1, seed=1)
        counts = simulate(f"{gateway}/v1", key, users, exclude=eval_prompts, user_secret=user_secret)
    assert counts["requests"] == 96 and not [k for k in counts if k.startswith("refused")], counts

    overrides = [f"{k}={json.dumps(v)}" for k, v in flat(yaml.safe_load(config.read_text())).items()]
    overrides.append("feedback.settle_s=0")
    collected = run_deployment("collect-feedback/collect-feedback", timeout=600, poll_interval=2,
                               parameters={"config_path": "configs/demo.yaml", "overrides": overrides})
    assert collected.state.is_completed(), collected.state
    [export] = (cfg.output_dir / "feedback").glob("feedback-*")
    manifest = json.loads((export / "manifest.json").read_text())
    assert manifest["pairs"] > 0 and set(manifest["served_versions"]) == {rated}, manifest

    before = set((cfg.output_dir).glob("*/summary.json"))
    nightly = run_deployment("rlhf-pipeline/nightly", timeout=1200, poll_interval=2,
                             parameters={"config_path": "configs/demo.yaml",
                                         "overrides": overrides + ["feedback.use=true", "policy.algorithm=kto",
                                                                   "policy.kto.max_length=16", "policy.lora.enabled=true",
                                                                   "reward.num_workers=1"]})  # 2: the first run
    [path] = set((cfg.output_dir).glob("*/summary.json")) - before
    second = json.loads(path.read_text())
    assert nightly.state.is_completed(), (nightly.state, second.get("error"))
    base_rows = summary["stages"]["validate"]["rows"]
    def triples(path):
        return {(r["prompt"], r["chosen"], r["rejected"]) for r in read_table(path).to_dict("records")}

    # feedback.weight 1: every feedback pair not already in the (same, seeded) base data
    base_file = Path(summary["output_dir"]) / "data" / "preferences.jsonl"
    new_pairs = triples(export / "preferences.jsonl") - triples(base_file)
    assert second["stages"]["validate"]["rows"] == base_rows + len(new_pairs)
    assert second["stages"]["validate"]["dataset_fingerprint"] != summary["stages"]["validate"]["dataset_fingerprint"]
    assert second["stages"]["policy"]["algorithm"] == "kto"
    # the thumbs: every rated answer once, none to an eval prompt, those to the pairs' held-out
    # prompts left out of training
    rated_answers = read_table(Path(second["output_dir"]) / "data" / "labelled-answers.jsonl")
    assert len(rated_answers) > 0 and not set(rated_answers["prompt"]) & set(eval_prompts)
    used = int(child_runs(client, second["mlflow_run_id"])["policy"].data.tags["kto.feedback_answers"])
    assert 0 < used <= len(rated_answers), (used, len(rated_answers))
    version = client.get_model_version("policy", second["stages"]["register"]["version"])
    assert version.tags["algorithm"] == "kto"
    assert version.tags["feedback.datasets"] == manifest["version"]
    assert version.tags["feedback.served_versions"] == rated
    # the gates took the KTO policy (loose here, as for the first run), and it serves
    assert second["stages"]["deploy"]["status"] == "serving", second["stages"]
    assert served(cfg, state_dir)[0] == [f"policy-v{version.version}"]
    parent = client.get_run(second["mlflow_run_id"])
    assert parent.data.tags["feedback.datasets"] == manifest["version"]


@pytest.mark.slow
def test_the_run_report_is_beside_the_summary_in_mlflow_and_opens_in_a_browser(full_run, tmp_path):
    from tests.browser import BrowserMissing, check_page

    _, _, _, summary = full_run
    report = Path(summary["summary_path"]).parent / "report.html"
    assert summary["report"] == {"path": str(report)}, summary["report"]
    client = MlflowClient(summary["mlflow_tracking_uri"])
    assert "report.html" in {a.path for a in client.list_artifacts(summary["mlflow_run_id"])}
    try:
        shown = check_page(report, screenshot=tmp_path / "report.png")
    except BrowserMissing as exc:
        pytest.fail(str(exc))
    print(f"run report screenshot: {tmp_path / 'report.png'}")
    assert {"Reward-model and audit score", "KL to the reference"} <= {i["alt"] for i in shown.images}, shown.images
    assert shown.broken_images == [] and shown.console_errors == [], (shown.images, shown.console_errors)
    assert shown.outside_links == [] and shown.requests == []
    assert "Labels asked: not plotted, no data" in report.read_text()  # the test's config has no preference rounds
