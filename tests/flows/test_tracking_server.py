"""The pipeline against a team's MLflow: a tracking server on PostgreSQL whose artifacts live in
an S3 bucket (moto), proxied by the server. The client process has no S3 credentials; the
model's weights go up in parts; what the registry hands back is what the policy stage wrote;
nothing lands in a local `mlruns/` or SQLite file. Two runs race to promote on it, as a
scheduled and a manual run would: one on the demo's own model and data, one on a user's own
model and data (a locally made pretrained Qwen2 with a chat template, conversational pairs, a
prompt-only RL set and an eval set saved with `datasets`), which wins, serves and answers a
chat through the `openai` client."""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import yaml
from mlflow.tracking import MlflowClient

from tasks.registry import CHAMPION, POLICY, fetch_version
from rlhf_core.config import DemoDataConfig, load_config
from rlhf_core.data.formats import as_conversational
from rlhf_core.data.schema import read_table, write_jsonl
from rlhf_core.data.synthetic import generate_demo_data
from tests.listeners import Listeners

LOOSE_GATES = {"auto_promote": True, "min_accuracy_gain": -1.0, "min_win_rate_vs_reference": 0.0,
               "min_win_rate_vs_champion": 0.0, "max_regression_vs_champion": 1.0, "max_length_ratio": 100.0,
               "max_degenerate_rate": 1.0, "max_kl": 1000.0, "max_generation_failure_rate": 1.0}
ZEPHYR = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def mlflow_tables(path: Path) -> bool:
    """Whether `path` is a SQLite file holding MLflow's tables (another store, e.g. the
    feedback gateway's, may live beside a run)."""
    if path.suffix not in (".db", ".sqlite") or not path.is_file():
        return False
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return bool(db.execute("SELECT 1 FROM sqlite_master WHERE name = 'experiments'").fetchone())


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def user_data(tmp: Path) -> tuple[Path, Path, Path]:
    """The demo task's rows in the ecosystem's formats: conversational pairs (JSONL), a prompt
    set with answers (Parquet), an eval set written by `save_to_disk`."""
    files = generate_demo_data(DemoDataConfig(n_sft=10, n_pairs=200, n_eval=24), tmp / "demo")
    pairs = [as_conversational(r) for r in read_table(files.preferences)[["prompt", "chosen", "rejected"]].to_dict("records")]
    evals = [as_conversational(r) for r in read_table(files.eval)[["prompt", "answer"]].to_dict("records")]
    write_jsonl(pairs, tmp / "pairs.jsonl")
    datasets.Dataset.from_list(evals).save_to_disk(str(tmp / "eval"))
    prompts = [{"prompt": r["prompt"], "answer": r["chosen"][0]["content"]} for r in pairs[:64]]
    datasets.Dataset.from_list(prompts).to_parquet(str(tmp / "prompts.parquet"))
    return tmp / "pairs.jsonl", tmp / "eval", tmp / "prompts.parquet"


def served_chat_is_rendered_as_in_training(url: str, key: str, model_dir: Path) -> None:
    """The server answers a chat through the `openai` client, and its rendering of the
    conversation is the trainer's (`model_dir`'s tokenizer and chat template), token for token."""
    import httpx
    from openai import OpenAI

    from rlhf_core.chat import render_prompt
    from rlhf_core.serving import server
    from rlhf_core.tokenizer import load_tokenizer

    [model] = server.list_models(url, key)
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "12+34="}]
    reply = OpenAI(base_url=f"{url}/v1", api_key=key).chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0.0)
    assert isinstance(reply.choices[0].message.content, str)
    served = httpx.post(f"{url}/tokenize", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                        json={"model": model, "messages": messages, "add_generation_prompt": True}).json()["tokens"]
    tokenizer = load_tokenizer(model_dir)
    assert served == tokenizer(render_prompt(tokenizer, messages))["input_ids"]
    assert reply.usage.prompt_tokens == len(served)


def own_model_config(raw: dict, tmp: Path, make_pretrained) -> dict:
    """`raw` (a test-sized config) on a user's own model and data: a pretrained Qwen2 with a chat
    template (`make_pretrained`), the data of `user_data`, SFT skipped, the policy rewarded by
    the reward model and by exact match against the prompt set's answer column."""
    pairs, evals, prompts = user_data(tmp)
    texts = [json.dumps(r) for r in read_table(pairs).to_dict("records")][:50]
    model_dir, _ = make_pretrained(tmp, "qwen2", chat_template=ZEPHYR, texts=texts + ["<|user|> <|assistant|>"])
    raw = {**raw, "data": {"preferences_path": str(pairs), "eval_path": str(evals), "prompts_path": str(prompts)},
           "model": {"pretrained": str(model_dir)}, "sft": {"enabled": False}}
    raw["reward"] = {**raw["reward"], "max_length": 96}
    raw["policy"] = {**raw["policy"], "verifiable_reward": "answer_exact_match", "verifiable_reward_weight": 1.0,
                     "reward_model_weight": 1.0}
    return raw


@pytest.mark.slow
def test_a_large_artifact_goes_up_in_parts_without_s3_credentials(mlflow_server, s3_server, tmp_path, monkeypatch):
    """The multipart settings as the pipeline's process has them: a file above the minimum is
    stored as a multipart object (its ETag ends in -<parts>) and comes back byte-identical."""
    for key in [k for k in os.environ if k.startswith("AWS_")] + ["MLFLOW_S3_ENDPOINT_URL"]:
        monkeypatch.delenv(key, raising=False)
    for key, value in mlflow_server.client_env.items():
        monkeypatch.setenv(key, value)
    chunk = int(mlflow_server.client_env["MLFLOW_MULTIPART_UPLOAD_CHUNK_SIZE"])
    data = os.urandom(5 * chunk + 123)
    (tmp_path / "weights.bin").write_bytes(data)
    client = MlflowClient(mlflow_server.url)
    exp = client.get_experiment_by_name("multipart") or client.get_experiment(client.create_experiment("multipart"))
    run = client.create_run(exp.experiment_id)
    client.log_artifact(run.info.run_id, str(tmp_path / "weights.bin"), artifact_path="model")
    client.set_terminated(run.info.run_id)

    key = f"{mlflow_server.prefix}/{exp.experiment_id}/{run.info.run_id}/artifacts/model/weights.bin"
    etag = s3_server.client().head_object(Bucket=mlflow_server.bucket, Key=key)["ETag"].strip('"')
    assert etag.endswith("-6"), etag  # 5 full parts and the rest
    back = client.download_artifacts(run.info.run_id, "model/weights.bin", str(tmp_path / "back"))
    assert Path(back).read_bytes() == data


def test_the_sampler_finds_every_listener_beyond_loopback():
    """The rules on made-up samples: the test below relies on them and cannot show them fail."""
    sampler = Listeners([])
    raylet = "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --node_ip_address=127.0.0.1"
    sampler.record(1, "ray::IDLE", raylet, {"127.0.0.1:4001"})  # a worker's gRPC server
    sampler.record(2, raylet, "python -m flows.cli run", {"127.0.0.1:4003", "::1:4004", "::ffff:127.0.0.1:4005"})
    sampler.record(3, "ray::RayTrainWorker", raylet, {"127.0.0.1:29500"})  # the store on loopback
    sampler.record(4, "python -m vllm.entrypoints.openai.api_server", "python -m flows.cli run", {"127.0.0.1:8000"})
    assert sampler.beyond_loopback() == {}
    sampler.record(1, "", raylet, {":::4001", "::ffff:10.0.0.2:4002"})  # a Ray server on every interface counts
    sampler.record(5, "", "python -m flows.cli run", {"0.0.0.0:4006"})  # an unknown exiting child of the driver
    sampler.record(4, "python -m vllm.entrypoints.openai.api_server", "python -m flows.cli run", {"0.0.0.0:8001"})
    assert sorted(sampler.beyond_loopback()) == [1, 4, 5]
    assert sampler.beyond_loopback()[5][0].startswith("(exited; parent python -m flows.cli run")
    sampler.record(6, "", raylet, set())
    sampler.record(6, "ray::IDLE", raylet, set())  # a later sample names it; the name stays
    sampler.record(6, "", raylet, set())
    assert sampler.seen[6][0] == "ray::IDLE"


LISTENER = """
import socket, sys
held = []
def listen(family, host):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.bind((host, 0)); s.listen(); held.append(s)
listen(socket.AF_INET, "127.0.0.1")
listen(socket.AF_INET, "0.0.0.0")
try:
    listen(socket.AF_INET6, "::1")
except OSError:  # a kernel without IPv6
    pass
held.append(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))  # open, not listening
print(len(held) - 1, flush=True)
sys.stdin.readline()
listen(socket.AF_INET, "127.0.0.2")
print(len(held) - 1, flush=True)
sys.stdin.readline()
"""


def test_the_sampler_reads_the_listening_sockets_psutil_reads():
    """The sampler reads the machine's socket table once a sample and looks through the
    processes only for a socket it has not seen; psutil, reading each process's own, is the
    reference. A child of a child listens on loopback, on every interface and (where the
    kernel has IPv6) on ::1, and later on one more address."""
    import psutil

    launcher = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {LISTENER!r}])"
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs = [psutil.Process(parent.pid)]
    try:
        made = int(parent.stdout.readline())
        procs += procs[0].children()
        child = procs[1]

        def psutils_view() -> set[str]:
            return {f"{c.laddr.ip}:{c.laddr.port}" for c in child.net_connections("inet") if c.status == psutil.CONN_LISTEN}

        sampler = Listeners([parent.pid])
        sampler.sample()
        first = psutils_view()
        assert made in (2, 3) and len(first) == made and sampler.seen[child.pid][1] == first, (sampler.seen, first)
        assert sampler.seen[parent.pid][1] == set()  # the parent holds none of them
        wide = {pid: addrs for pid, (_, addrs) in sampler.beyond_loopback().items()}
        assert wide == {child.pid: [a for a in first if a.startswith("0.0.0.0:")]}, sampler.beyond_loopback()
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert int(parent.stdout.readline()) == made + 1
        sampler.sample()
        now = psutils_view()
        assert len(now) == made + 1 and sampler.seen[child.pid][1] == now and now - first, (sampler.seen, now)
    finally:
        for proc in reversed(procs):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        parent.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.usefixtures("prefect_server")
def test_two_runs_started_together_on_the_server_leave_one_champion_from_the_bucket_that_serves(
        mlflow_server, s3_server, tmp_path, tiny_config_factory, free_ports, make_pretrained):
    """Two runs (a scheduled one and a manual one) started together against the team's server,
    one serving state, both judged against no champion: the first to promote wins and serves,
    the second finds a champion it was not judged against and is refused with a message that
    says so. The two meet before promoting (`fault_injection.wait_point`), so the race is the
    same every time. The champion is what serves, fetched from the bucket through the server.
    Every socket the runs' processes listen on is sampled: nothing beyond loopback.

    The winner (run 0) is a user's own model and data through every stage: validate, SFT
    skipped, reward model, GRPO, gates, registry, deployment; vLLM's server renders a chat as
    the trainer did, token for token. The loser (run 1) is the demo's own model, SFT included."""
    import time

    from prefect.settings import PREFECT_API_URL

    from rlhf_core.serving import server

    demo = tiny_config_factory(tmp_path)
    demo["gates"].update(LOOSE_GATES)
    demo["serving"] = {"ports": free_ports(2), "smoke_prompt": "12+34="}
    demo["tracking"]["tracking_uri"] = mlflow_server.url
    own = own_model_config(demo, tmp_path / "own", make_pretrained)
    own["serving"] = {**demo["serving"], "smoke_prompt": "Hello"}
    configs = [tmp_path / "own.yaml", tmp_path / "demo.yaml"]  # run i's config
    for path, raw in zip(configs, (own, demo)):
        path.write_text(yaml.safe_dump(raw))
    state_dir = tmp_path / "runs" / "serving"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RLHF_FAULT", "MLFLOW_TRACKING_URI",
                                                            "MLFLOW_S3_ENDPOINT_URL") and not k.startswith("AWS_")}
    env.update(mlflow_server.client_env, PREFECT_API_URL=PREFECT_API_URL.value())
    go = [tmp_path / f"promote-{i}" for i in range(2)]  # created by the test: run i may promote
    client = MlflowClient(mlflow_server.url)

    def until(what: str, check) -> None:
        deadline = time.monotonic() + 900
        while not check():
            dead = [i for i, p in enumerate(procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = [(tmp_path / f"run{i}.log").read_text()[-3000:] for i in range(2)]
                raise AssertionError(f"{what}: run(s) {dead} ended, exit {[p.poll() for p in procs]}\n{logs}")
            time.sleep(0.2)

    procs: list[subprocess.Popen] = []
    try:
        procs += [subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--config", str(configs[i])], cwd=cwd,
                                  env={**env, "RLHF_FAULT": f"wait:register:promote={go[i]}"},
                                  stdout=open(tmp_path / f"run{i}.log", "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True) for i in range(2)]
        listeners = Listeners([p.pid for p in procs])
        listeners.start()
        until("both candidates registered, neither promoted", lambda: all(Path(f"{g}.waiting").exists() for g in go))
        go[0].touch()
        until("run 0 promoted", lambda: CHAMPION in client.get_registered_model(POLICY).aliases)
        go[1].touch()
        codes = [p.wait(1300) for p in procs]
        listeners.stop()
        logs = [(tmp_path / f"run{i}.log").read_text()[-3000:] for i in range(2)]
        summaries = [json.loads(p.read_text()) for p in sorted((tmp_path / "runs").glob("test-*/summary.json"))]
        assert len(summaries) == 2, logs  # two runs, two output directories

        completed = [s for s in summaries if s["status"] == "completed"]
        refused = [s for s in summaries if s["status"] != "completed"]
        assert codes == [0, 1] and len(completed) == len(refused) == 1, (codes, logs)
        for s in refused:  # lost the race: told which champion it found and what to do
            assert s["failed_stage"] == "register", s
            assert "as expected (another run or a person moved it meanwhile)" in s["error"], s
            assert "rlhf evaluate" in s["error"]

        # the loser is the demo's run, which trained its own SFT policy
        [lost] = refused
        assert lost["stages"]["sft"]["status"] == "completed", lost["stages"]["sft"]
        assert lost["stages"]["sft"]["trained_by_run"] == lost["mlflow_run_id"]
        # and is on the server as a run that failed for that reason, after every stage before it finished
        lost_parent = client.get_run(lost["mlflow_run_id"])
        assert lost_parent.info.status == "FAILED" and lost_parent.data.tags["failure_reason"] == lost["error"][:5000]
        lost_stages = {r.info.run_name: r.info.status for r in client.search_runs(
            [lost_parent.info.experiment_id], f"tags.mlflow.parentRunId = '{lost_parent.info.run_id}'")}
        assert lost_stages == dict.fromkeys(("validate", "sft", "reward", "policy", "evaluate"), "FINISHED"), lost_stages

        # the winner is the user's own model through every stage, SFT skipped
        [won] = completed
        assert won["stages"]["pretrained"]["model_type"] == "qwen2", won["stages"]
        assert won["stages"]["sft"]["status"] == "skipped", won["stages"]["sft"]
        assert won["stages"]["policy"]["status"] == "completed" and won["stages"]["policy"]["accuracy_before"] is not None
        assert won["stages"]["deploy"]["status"] == "serving", won["stages"]

        # the completed run: the parent run and a nested run per stage are on the server
        stage_runs = {}
        for s in completed:
            assert s["mlflow_tracking_uri"] == mlflow_server.url
            parent = client.get_run(s["mlflow_run_id"])
            assert parent.info.status == "FINISHED" and parent.info.artifact_uri.startswith("mlflow-artifacts:")
            stages = {r.info.run_name: r for r in client.search_runs(
                [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")}
            assert set(stages) == {"validate", "sft", "reward", "policy", "evaluate"}
            assert stages["sft"].data.tags["sft.skipped"] == "true"
            assert all(r.info.status == "FINISHED" for r in stages.values())
            metrics = stages["policy"].data.metrics  # both rewards: the reward model's and exact match
            assert "policy/verifiable_reward_mean" in metrics and "policy/rm_score_mean" in metrics, sorted(metrics)
            stage_runs[str(s["stages"]["register"]["version"])] = (s, parent, stages)
        exp = client.get_experiment_by_name("tests").experiment_id
        assert not client.search_runs([exp], "attributes.status = 'RUNNING'")

        # the champion is a completed run's policy model, byte for byte, through the server
        champion = client.get_model_version_by_alias(POLICY, CHAMPION)
        assert champion.version in stage_runs
        summary, parent, stages = stage_runs[champion.version]
        assert champion.run_id == stages["policy"].info.run_id
        written = files_of(Path(summary["stages"]["policy"]["model_path"]))
        assert "model.safetensors" in written
        fetched = files_of(fetch_version(mlflow_server.url, champion.version, tmp_path / "serving-models"))  # deploy's path
        assert {name: fetched[name] for name in written} == written
        assert set(fetched) - set(written) == {"README.md"}  # the model card the register stage adds

        # the objects are in the bucket under the artifact prefix, the weights uploaded in parts
        s3 = s3_server.client()
        run_root = f"{mlflow_server.prefix}/{parent.info.experiment_id}/{champion.run_id}/artifacts/model/"
        listed = s3.list_objects_v2(Bucket=mlflow_server.bucket, Prefix=run_root)["Contents"]
        assert {o["Key"].removeprefix(run_root) for o in listed} == set(fetched)
        weights = s3.head_object(Bucket=mlflow_server.bucket, Key=run_root + "model.safetensors")
        chunk = int(mlflow_server.client_env["MLFLOW_MULTIPART_UPLOAD_CHUNK_SIZE"])
        parts = math.ceil(len(written["model.safetensors"]) / chunk)
        assert parts > 1 and weights["ETag"].strip('"').endswith(f"-{parts}"), (weights["ETag"], parts)
        config_key = f"{mlflow_server.prefix}/{parent.info.experiment_id}/{parent.info.run_id}/artifacts/config.yaml"
        assert s3.head_object(Bucket=mlflow_server.bucket, Key=config_key)["ETag"].count("-") == 0  # small: one PUT

        # the champion serves, deployed from what the server handed back
        current = server.current_endpoint(state_dir)
        assert current is not None and current.version == champion.version and server.health(current.url)
        assert not (state_dir / "starting.json").exists()
        key = server.resolve_api_key(load_config(configs[0]).serving, state_dir)
        served_chat_is_rendered_as_in_training(current.url, key, Path(won["stages"]["policy"]["model_path"]))

        # nothing tracked locally: no mlruns/, mlartifacts/ or MLflow SQLite file where they ran or wrote
        for root in (cwd, tmp_path / "runs"):
            local = [p for p in root.rglob("*") if p.name in ("mlruns", "mlartifacts", "mlflow.db") or mlflow_tables(p)]
            assert local == [], local

        # nothing of the runs listened beyond loopback (and the sampler saw what it must have)
        assert current.pid in listeners.seen, "the sampler never saw the served model"
        assert any(("default_worker.py" in cmd or cmd.startswith("ray::")) and any(a.startswith("127.0.0.1:") for a in addrs)
                   for cmd, addrs in listeners.seen.values()), "nor a training worker's rendezvous"
        assert any("gcs_server" in cmd and addrs for cmd, addrs in listeners.seen.values()), "nor Ray's GCS"
        assert listeners.beyond_loopback() == {}, listeners.beyond_loopback()
        print(f"\nexit codes {codes} | champion v{champion.version}: {len(written)} files byte-identical through the "
              f"server; model.safetensors {len(written['model.safetensors'])} bytes in {parts} parts")
    finally:
        for proc in procs:  # a run still going after a failed check: stop it and its cluster
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(60)
        server.stop(state_dir)
