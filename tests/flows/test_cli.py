import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from flows import cli, serving_commands
from flows.cli import _parser, main
from flows.prefect_setup import stop_when_started
from rlhf_core.config import load_config
from rlhf_core.config.default import DEFAULT_CONFIG, OWN_DATA_CONFIG

REPO = Path(__file__).resolve().parents[2]


def _subcommands() -> dict[str, str]:
    """Every subcommand of `rlhf` and its one-line help, as the parser defines them."""
    action = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {choice.dest: choice.help for choice in action._choices_actions}


def test_help_lists_every_subcommand_with_its_help_line():
    out = subprocess.run([sys.executable, "-m", "flows.cli", "--help"], capture_output=True, text=True, check=True,
                         env={**os.environ, "COLUMNS": "200"})
    commands = _subcommands()
    assert {"run", "demo", "validate", "check-config", "make-demo-data", "evaluate", "promote", "deploy",
            "rollback", "serving", "canary", "gateway", "collect-feedback", "env"} == set(commands)
    for name, help_line in commands.items():
        assert re.search(rf"^\s+{re.escape(name)}\s+{re.escape(help_line)}$", out.stdout, re.M), (name, out.stdout)


def test_the_module_docstring_lists_exactly_the_parsers_subcommands():
    listed = re.findall(r"^    rlhf ([a-z-]+)", cli.__doc__, re.M)
    assert list(dict.fromkeys(listed)) == list(_subcommands())


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_subcommand_takes_debug_and_a_config_that_defaults_to_a_packaged_one(command):
    # `rlhf run` trains your data (own-data.yaml: no task of the demo's); the others default to the demo's
    required = {"validate": ["x.jsonl"], "check-config": ["c.yaml"], "make-demo-data": ["out"], "promote": ["3"],
                "rollback": ["--incident", "i", "--reason", "r"], "canary": ["status"]}.get(command, [])
    args = _parser().parse_args([command, *required, "--debug"])
    assert args.debug is True
    packaged = OWN_DATA_CONFIG if command == "run" else DEFAULT_CONFIG
    if command != "check-config":
        assert args.config == packaged and Path(packaged).is_absolute() and Path(packaged).is_file()


def test_run_without_a_config_trains_your_data_with_no_part_of_the_demos_task(capsys):
    from rlhf_core.config import PipelineConfig

    args = _parser().parse_args(["run", "--set", "model.pretrained=/models/mine", "--set",
                                 "data.preferences_path=my/prefs.jsonl"])
    cfg = load_config(args.config, args.overrides)
    assert cfg.data.preferences_path == "my/prefs.jsonl"  # not the generated demo task
    assert cfg.policy.verifiable_reward is None and not cfg.policy.rounds.enabled  # no answer key, no simulated rater
    assert cfg.gates.regression_suites == [] and cfg.policy.min_accuracy_gain == 0 and not cfg.gates.auto_promote
    defaults = PipelineConfig()
    assert cfg.name == defaults.name and cfg.sft == defaults.sft and cfg.model.initializer_range == 0.02
    assert cfg.serving.smoke_prompt == defaults.serving.smoke_prompt  # not the demo's "12+34="
    # and without data it says what to do instead of generating the demo's
    assert main(["run"]) == 2
    assert "data.preferences_path is not set" in capsys.readouterr().err


def test_bad_config_exits_2_naming_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sft:\n  learning_rate: -1\n")
    assert main(["check-config", str(bad)]) == 2
    assert "sft.learning_rate: must be > 0, got -1" in capsys.readouterr().err
    assert main(["run", "--config", str(bad)]) == 2


def test_resume_of_a_run_that_cannot_continue_exits_2_saying_why_before_any_server_starts(tiny_config, capsys):
    assert main(["run", "--config", str(tiny_config), "--resume", "0" * 32]) == 2
    assert f"cannot resume {'0' * 32}: no such run in sqlite:///" in capsys.readouterr().err
    assert main(["run", "--config", str(tiny_config), "--resume", "0" * 32, "--set", "sft.epochs=2"]) == 2
    assert "--set cannot change a resumed run" in capsys.readouterr().err


def test_validate_of_a_missing_file_is_a_usage_error(capsys):
    assert main(["validate", "/nonexistent/prefs.jsonl"]) == 2
    assert "no such file or directory: /nonexistent/prefs.jsonl" in capsys.readouterr().err


@pytest.mark.slow
def test_a_flow_command_without_a_prefect_server_starts_one_temporary_server(tmp_path):
    """With no PREFECT_API_URL the CLI starts Prefect's temporary server while it imports the
    flow's libraries; the flow must then use that server, not start a second one (Prefect
    logs each start), and the command must work as before."""
    config = {"base": str(REPO / "configs" / "demo.yaml"), "output_dir": str(tmp_path / "runs")}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    assert main(["make-demo-data", str(tmp_path / "data"), "--config", str(tmp_path / "config.yaml")]) == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "validate", "--record", str(tmp_path / "data" / "preferences.jsonl"),
         "--config", str(tmp_path / "config.yaml")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert log.count("Starting temporary server") == 1, log[-3000:]
    assert "validate-data: COMPLETED" in out.stdout


def _sigterm_once_running(tmp_path: Path, config_args: list[str], marker: str) -> tuple[int, str, list]:
    """Start `rlhf run` (Prefect's temporary server, MLflow in tmp_path), send SIGTERM once one of
    its processes has `marker` in its command line -> (exit status, output, its processes that
    outlived it by 30 s)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")
    log = tmp_path / "run.log"  # not a pipe: a process left running would hold it open
    with log.open("w") as sink:
        run = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", *config_args], cwd=REPO, env=env,
                               stdout=sink, stderr=subprocess.STDOUT, text=True)
    family: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while run.poll() is None and time.monotonic() < deadline:
            family = psutil.Process(run.pid).children(recursive=True)
            if any(marker in " ".join(_cmdline(p)) for p in family):
                break
            time.sleep(0.2)
        assert run.poll() is None, f"the run ended before {marker!r} started:\n{log.read_text()[-3000:]}"
        assert family, f"no {marker!r} within 300 s"
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=120)
        _, alive = psutil.wait_procs(family, timeout=30)
        left = [" ".join(_cmdline(p))[:120] for p in alive if not _ended(p)]  # named before they are killed
    finally:
        run.kill()
        for p in family:
            with contextlib.suppress(psutil.Error):
                p.kill()
    return run.returncode, log.read_text(), left


def _ended(p: psutil.Process) -> bool:
    """Gone, or a zombie: it exited, and its new parent (init, once the run is gone) may be slow to reap it."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:  # gone, or a zombie
        return []


@pytest.mark.slow  # starts Prefect's temporary server
def test_a_sigterm_while_the_flow_imports_stops_prefects_temporary_server_too(tmp_path):
    """`kill` of a run before its flow starts (Prefect's server already starting, the flow's
    libraries still importing) ends it with 143 and takes the server down with it."""
    status, out, left = _sigterm_once_running(tmp_path, ["--config", DEFAULT_CONFIG, "--set", f"output_dir={tmp_path / 'runs'}"],
                                              "uvicorn")
    assert status == 143, out[-3000:]
    assert "rlhf: stopped by SIGTERM" in out and "flow run" not in out.lower()
    assert left == []


def test_an_exit_while_prefects_server_is_being_spawned_still_stops_it(monkeypatch):
    """The early start's thread spawns the server, and only then does Prefect register its stop
    at exit. An exit in between (a SIGTERM during the imports, on a busy machine) must not leave
    the server's process behind: the exit handler waits for the spawn and stops it."""
    from prefect.server.api.server import SubprocessASGIServer  # the server's app: not for every test's collection

    spawned, go_on = threading.Event(), threading.Event()
    children: list[subprocess.Popen] = []

    def spawn_then_stall(self):  # Prefect's spawn, with the thread held just after it
        children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]))
        spawned.set()
        go_on.wait(1.0)
        return children[-1]

    monkeypatch.setattr(SubprocessASGIServer, "_run_uvicorn_command", spawn_then_stall)
    monkeypatch.setattr(SubprocessASGIServer, "_instances", {})  # not the instance a flow in this process uses
    server = SubprocessASGIServer(port=1)  # nothing answers there: the health poll only waits

    def start() -> None:
        with contextlib.suppress(Exception):  # it fails once stopped: the early start's thread ignores that too
            server.start(timeout=3)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    try:
        assert spawned.wait(30)
        assert server.server_process is None  # the window: spawned, and no stop registered yet
        stop_when_started(server, thread)
        assert children[0].wait(timeout=10) is not None
    finally:
        go_on.set()
        thread.join(10)
        for child in children:
            child.kill()
            child.wait()


@pytest.mark.slow  # a pipeline up to its reward stage
def test_a_sigterm_in_a_ray_stage_stops_the_local_cluster_and_prefects_server_with_the_run(tiny_config, tmp_path):
    """`kill` during the reward stage (Ray Train workers up, on a local cluster the run started)
    ends the run with 143 within seconds, and none of its processes outlives it: Prefect's
    temporary server, Ray's GCS, raylet and agents, the Train controller and workers."""
    status, out, left = _sigterm_once_running(tmp_path, ["--config", str(tiny_config)], "ray::RayTrainWorker")
    assert status == 143, out[-3000:]
    assert "stopped by SIGTERM in a Ray stage" in out and "Stopping temporary server" in out
    assert left == []


def _rows(n: int = 150, same: int = 0) -> list[dict]:
    """`n` distinct addition pairs; the first `same` have chosen == rejected."""
    return [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 1) if i < same else str(i)}
            for i in range(n)]


def _rlhf_from(cwd: Path, *args: str, prefect_api: str | None = None) -> subprocess.CompletedProcess:
    """`rlhf ARGS` in a fresh process started in `cwd` (outside the checkout), with its default
    config; with `prefect_api`, on that Prefect server (else a flow starts a temporary one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(cwd / "prefect"), PYTHONPATH=str(REPO), MLFLOW_TRACKING_URI=f"sqlite:///{cwd / 'mlflow.db'}")
    if prefect_api:
        env["PREFECT_API_URL"] = prefect_api
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def _bad_file(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(same=3)))


def _paths_in(block: str, *names: str) -> list[Path]:
    return [Path(re.search(rf"{name}:\s+(\S+)", block).group(1)) for name in names]


def test_validate_of_bad_data_from_another_directory_prints_one_block_and_no_traceback(tmp_path):
    _bad_file(tmp_path)
    started = time.perf_counter()
    out = _rlhf_from(tmp_path, "validate", "bad.jsonl")
    seconds = time.perf_counter() - started
    terminal = out.stdout + out.stderr
    assert out.returncode == 1, terminal[-3000:]
    assert "Traceback" not in terminal and "ERROR" not in terminal, terminal[-3000:]
    assert "validate: FAILED at stage 'validate'" in out.stdout
    assert "chosen_differs_from_rejected: 3 rows where chosen == rejected (lines 1, 2, 3)" in out.stdout
    assert "exit code 1" in out.stdout
    report, summary = _paths_in(out.stdout, "report", "summary")
    assert report.is_file() and report.is_relative_to(tmp_path)
    assert json.loads(summary.read_text())["failed_stage"] == "validate"
    assert seconds < 60, seconds  # no Prefect server, no MLflow: Great Expectations' time, not a pipeline's


def test_validate_reads_a_bom_crlf_file_from_another_directory(tmp_path):
    (tmp_path / "windows.jsonl").write_bytes(
        b"\xef\xbb\xbf" + b"".join(json.dumps(r).encode() + b"\r\n" for r in _rows()))
    out = _rlhf_from(tmp_path, "validate", "windows.jsonl")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "validate: PASSED  150 rows" in out.stdout
    (report,) = _paths_in(out.stdout, "report")
    report = json.loads(report.read_text())
    assert report["success"] and report["read_notes"] == ["UTF-8 byte-order mark skipped", "CRLF line ends"]


@pytest.mark.slow
def test_a_recorded_validation_failure_keeps_its_tracebacks_in_the_log_file(tmp_path, prefect_server):
    """On a Prefect server (the temporary one a flow starts without it: the test above)."""
    from prefect.settings import PREFECT_API_URL

    _bad_file(tmp_path)
    out = _rlhf_from(tmp_path, "validate", "--record", "bad.jsonl", prefect_api=PREFECT_API_URL.value())
    terminal = out.stdout + out.stderr
    assert out.returncode == 1, terminal[-3000:]
    assert "Traceback" not in terminal and "ERROR" not in terminal, terminal[-3000:]
    assert "validate-data: FAILED at stage 'validate'" in out.stdout
    assert "chosen_differs_from_rejected: 3 rows where chosen == rejected (lines 1, 2, 3)" in out.stdout
    report, summary, log = _paths_in(out.stdout, "report", "summary", "log")
    assert report.is_file() and json.loads(summary.read_text())["failed_stage"] == "validate"
    assert log.is_relative_to(tmp_path) and "Traceback" in log.read_text()  # the tracebacks went there


def test_a_command_run_outside_the_checkout_finds_the_packaged_default_config(tmp_path):
    out = _rlhf_from(tmp_path, "make-demo-data", "data")
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "data" / "preferences.jsonl").is_file() and "file not found" not in out.stderr


def test_validate_of_a_file_that_is_not_jsonl_names_file_and_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.jsonl").write_text(json.dumps(_rows(1)[0]) + "\n{not json\n")
    assert main(["validate", "broken.jsonl"]) == 1
    out = capsys.readouterr().out
    assert "cause:    broken.jsonl:2: not valid JSON" in out and "report:" not in out and "exit code 1" in out
    (summary,) = _paths_in(out, "summary")
    assert json.loads(summary.read_text())["status"] == "failed"


def test_validate_renders_conversational_data_with_the_configured_model(tmp_path, capsys, make_pretrained):
    """`rlhf validate` on conversational rows: rendered with model.pretrained's template, then the
    contract; a roles-out-of-order row is named before any contract runs."""
    from rlhf_core.data.schema import write_jsonl

    chatml = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    model, _ = make_pretrained(tmp_path, "qwen2", chat_template=chatml)
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} plus {i}?"}],
             "chosen": [{"role": "assistant", "content": str(2 * i)}],
             "rejected": [{"role": "assistant", "content": str(2 * i + 1)}]} for i in range(120)]
    write_jsonl(rows, tmp_path / "chat.jsonl")
    config = tmp_path / "c.yaml"
    config.write_text(f"output_dir: {tmp_path / 'runs'}\nmodel:\n  pretrained: {model}\nreward:\n  max_length: 64\n")
    assert main(["validate", str(tmp_path / "chat.jsonl"), "--config", str(config)]) == 0
    [rendered] = (tmp_path / "runs").glob("validate-*/data/preferences.jsonl")
    assert rendered.read_text().startswith('{"prompt": "<|im_start|>user\\nWhat is 0 plus 0?<|im_end|>\\n')
    rows[7]["prompt"].append({"role": "user", "content": "again"})
    write_jsonl(rows, tmp_path / "chat.jsonl")
    assert main(["validate", str(tmp_path / "chat.jsonl"), "--config", str(config)]) == 1
    assert "row 8 (line 8), column 'prompt': turn 1 is 'user' where 'assistant' was expected" in capsys.readouterr().out


FAKE_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[-1])), H).serve_forever()
"""


def test_serving_status_says_when_what_serves_is_not_the_registrys_champion(tmp_path, capsys, free_ports):
    """A healthy server of policy v1 while the registry's champion is v2: exit 4 and what to
    run; once the champion is v1 again, exit 0."""
    from mlflow.tracking import MlflowClient

    from rlhf_core.serving.server import SERVER_MODULE, Endpoint, health
    from rlhf_core.serving.state import write_json_atomic

    port = free_ports(1)[0]
    server = subprocess.Popen([sys.executable, "-c", FAKE_SERVER, SERVER_MODULE, "--port", str(port)])
    try:
        state = tmp_path / "serving"
        state.mkdir()
        write_json_atomic(state / "current.json", Endpoint(
            url=f"http://127.0.0.1:{port}", host="127.0.0.1", port=port, pid=server.pid, served_model_name="policy-v1",
            version="1", model_dir="/m", log_path="/l", started_at="2024-01-01T00:00:00+00:00").to_dict())
        uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
        client = MlflowClient(uri, registry_uri=uri)
        client.create_registered_model("policy")
        for _ in range(2):
            client.create_model_version("policy", str(tmp_path))
        client.set_registered_model_alias("policy", "champion", "2")
        deadline = time.monotonic() + 30
        while not health(f"http://127.0.0.1:{port}", timeout=1) and time.monotonic() < deadline:
            time.sleep(0.2)
        args = ["serving", "status", "--set", f"serving.state_dir={state}", "--set", f"tracking.tracking_uri={uri}"]
        assert main(args) == 4
        out = capsys.readouterr()
        assert json.loads(out.out)["champion"] == "2"
        assert "serving policy-v1, but the registry's champion is v2: `rlhf deploy`" in out.err
        client.set_registered_model_alias("policy", "champion", "1")
        assert main(args) == 0
        assert capsys.readouterr().err == ""
    finally:
        server.kill()
        server.wait()


def _registry(tmp_path: Path, versions: int, champion: str | None = None, name: str = "policy"):
    """A real MLflow store with `name` v1..v<versions> (no files) and `champion` on one of them."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri, registry_uri=uri)
    if versions:
        client.create_registered_model(name)
        for _ in range(versions):
            client.create_model_version(name, str(tmp_path))
    if champion is not None:
        client.set_registered_model_alias(name, "champion", champion)
    return client, uri


def test_two_configs_with_their_own_registered_models_share_a_store_without_touching_each_other(tmp_path, capsys):
    """`tracking.registered_model` names the lineage a config promotes, rolls back and serves:
    the chat model's promotion and rollback leave the demo's `policy` champion alone."""
    from prefect.logging import disable_run_logger

    from flows.serving_commands import _registry_champion
    from rlhf_core.config import load_config
    from rlhf_core.config.default import DEFAULT_CONFIG
    from tasks.deploy import move_champion_back
    from tasks.feedback import rolled_back_versions

    client, uri = _registry(tmp_path, 2, champion="2")
    _registry(tmp_path, 3, champion="1", name="chat-policy")
    chat = ["--set", f"tracking.tracking_uri={uri}", "--set", "tracking.registered_model=chat-policy"]
    assert main(["promote", "3", "--by", "bob", *chat]) == 0
    assert "chat-policy v3 is now the champion (previous: v1)" in capsys.readouterr().out

    def champions() -> tuple[int, int]:
        return tuple(client.get_model_version_by_alias(n, "champion").version for n in ("policy", "chat-policy"))

    assert champions() == (2, 3)
    cfg = load_config(DEFAULT_CONFIG, [f"tracking.tracking_uri={uri}", "tracking.registered_model=chat-policy"])
    assert _registry_champion(cfg) == ("3", "")
    with disable_run_logger():
        plan = move_champion_back.fn(cfg, "INC-7", "KL spike", "alertmanager:rlhf", None)
    assert (plan.from_version, plan.to_version, champions()) == ("3", "1", (2, 1))
    assert rolled_back_versions(client, "chat-policy") == {"3"} and rolled_back_versions(client, "policy") == set()
    assert "rolled_back_from" not in client.get_model_version("policy", "1").tags


def test_promote_refuses_a_rolled_back_version_unless_forced_with_a_reason(tmp_path, capsys):
    from tasks.registry import promote, start_rollback

    client, uri = _registry(tmp_path, 2)
    promote(client, "1", "alice", "v1")
    promote(client, "2", "alice", "v2")
    start_rollback(client, "INC-3", "error rate on v2", "alertmanager:rlhf")
    args = ["promote", "2", "--by", "bob", "--set", f"tracking.tracking_uri={uri}"]

    assert main(args) == 1
    err = capsys.readouterr().err
    assert "policy v2 was rolled back (incident INC-3, " in err and "error rate on v2" in err
    assert "`rlhf promote 2 --force --reason TEXT`" in err
    assert main([*args, "--force"]) == 1
    assert "a forced promotion of it needs a reason (`--reason TEXT`)" in capsys.readouterr().err
    assert client.get_model_version_by_alias("policy", "champion").version == 1

    assert main([*args, "--force", "--reason", "the error came from the gateway, not the model"]) == 0
    assert "policy v2 is now the champion (previous: v1)" in capsys.readouterr().out
    tags = client.get_model_version("policy", "2").tags
    assert tags["promoted_by"] == "bob"
    assert tags["promotion_reason"] == ("the error came from the gateway, not the model "
                                        "(forced past the rollback of incident INC-3)")


def test_serving_status_says_a_deploy_is_under_way(tmp_path, capsys, free_ports, monkeypatch):
    """A real deploy (`server.deploy`) whose server is a stand-in that never turns healthy:
    while it waits, `serving status` names its version, start time and server pid; once it has
    failed, no deploy is under way."""
    import threading

    from rlhf_core.config import ServingConfig
    from rlhf_core.serving import server

    def launch(model_dir, name, port, max_model_len, cfg, api_key, log_path):
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)

    waiting, release = threading.Event(), threading.Event()

    def check_new_server(proc, endpoint, api_key, cfg):
        waiting.set()
        release.wait(60)
        raise server.ServingError("the test ends this deploy")

    monkeypatch.setattr(server, "launch", launch)
    monkeypatch.setattr(server, "_check_new_server", check_new_server)
    state, model = tmp_path / "serving", tmp_path / "model"
    model.mkdir()
    failed: list[BaseException] = []

    def deploy():
        try:
            server.deploy(model, "3", ServingConfig(ports=tuple(free_ports(2)), max_model_len=64), state)
        except server.ServingError as e:
            failed.append(e)

    args = ["serving", "status", "--set", f"serving.state_dir={state}",
            "--set", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    thread = threading.Thread(target=deploy)
    thread.start()
    try:
        assert waiting.wait(60)
        starting = json.loads((state / "starting.json").read_text())
        assert main(args) == 1
        assert capsys.readouterr().out == (f"nothing is serving; a deploy is under way (version 3, since "
                                           f"{starting['started_at']}, pid {starting['pid']})\n")
        assert starting["pid"] > 0
    finally:
        release.set()
        thread.join(60)
    assert failed and main(args) == 1
    assert capsys.readouterr().out == "nothing is serving\n"


def test_serving_status_names_a_deploy_that_died_before_it_finished(tmp_path, capsys):
    """The intent record of a deploy killed before its server started, and no deploy holding the
    lock: status says so, and what cleans it up."""
    from rlhf_core.serving.server import STARTING, Endpoint
    from rlhf_core.serving.state import deploy_lock, write_json_atomic

    state = tmp_path / "serving"
    state.mkdir()
    with deploy_lock(state):  # as `server.deploy` writes it, under the lock; then it died
        write_json_atomic(state / STARTING, Endpoint(
            url="http://127.0.0.1:1", host="127.0.0.1", port=1, pid=0, served_model_name="policy-v4", version="4",
            model_dir="/m", log_path="/l", started_at="2024-01-01T00:00:00+00:00").to_dict())
    assert main(["serving", "status", "--set", f"serving.state_dir={state}"]) == 1
    assert capsys.readouterr().out == (
        "nothing is serving; a deploy of version 4 did not finish (since 2024-01-01T00:00:00+00:00, its server not "
        "started yet); the next deploy or `rlhf serving stop` stops what it left\n")


def _fake_server(port: int, state: Path, version: str) -> subprocess.Popen:
    """A process that answers /health on `port`, recorded as serving `version` in `state`."""
    from rlhf_core.serving.server import SERVER_MODULE, Endpoint, health
    from rlhf_core.serving.state import write_json_atomic

    proc = subprocess.Popen([sys.executable, "-c", FAKE_SERVER, SERVER_MODULE, "--port", str(port)])
    state.mkdir(exist_ok=True)
    write_json_atomic(state / "current.json", Endpoint(
        url=f"http://127.0.0.1:{port}", host="127.0.0.1", port=port, pid=proc.pid, served_model_name=f"policy-v{version}",
        version=version, model_dir="/m", log_path="/l", started_at="2024-01-01T00:00:00+00:00").to_dict())
    deadline = time.monotonic() + 30
    while not health(f"http://127.0.0.1:{port}", timeout=1) and time.monotonic() < deadline:
        time.sleep(0.2)
    return proc


@pytest.mark.parametrize("versions, champion, serving, flow", [
    (0, None, False, "rlhf_pipeline"),  # a fresh checkout: the demo trains a champion
    (2, "2", False, "deploy_champion_flow"),  # after `rlhf serving stop`: the champion is deployed, nothing trained
    (2, "2", True, None),  # it serves: nothing to do
])
def test_serving_ensure_runs_what_the_state_needs(tmp_path, capsys, free_ports, monkeypatch, versions, champion,
                                                   serving, flow):
    """`rlhf serving ensure` (the first step of `make demo-loop`) against a real registry and
    serving state; the flows it would run are stand-ins that record the call."""
    from types import SimpleNamespace

    _, uri = _registry(tmp_path, versions, champion)
    state = tmp_path / "serving"
    args = ["serving", "ensure", "--set", f"serving.state_dir={state}", "--set", f"tracking.tracking_uri={uri}"]
    called = []

    def stand_in(name, result):
        def run(**kwargs):
            called.append((name, kwargs))
            return SimpleNamespace(result=lambda: result)
        return run

    summary = {"pipeline": "rlhf-pipeline", "status": "completed", "mlflow_run_id": "r", "mlflow_experiment_id": "1",
               "mlflow_tracking_uri": uri, "summary_path": "/s.json", "prefect_flow_run_id": "f"}
    flows = SimpleNamespace(rlhf_pipeline=stand_in("rlhf_pipeline", summary),
                            deploy_champion_flow=stand_in("deploy_champion_flow", {"status": "serving"}))
    monkeypatch.setattr(serving_commands, "flow_module", lambda module, a, cfg: (flows, tmp_path / "log"))
    proc = _fake_server(free_ports(1)[0], state, "1") if serving else None
    try:
        assert main(args) == 0
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    assert [name for name, _ in called] == ([flow] if flow else [])
    if flow:
        assert called[0][1]["overrides"] == args[2:][1::2] and called[0][1]["config_path"] == DEFAULT_CONFIG
    out = capsys.readouterr().out
    assert {"rlhf_pipeline": "there is no champion: running the demo", "deploy_champion_flow":
            "deploying the champion, policy v2", None: "policy v1 serves"}[flow] in out


def test_the_readmes_command_list_names_exactly_the_parsers_subcommands():
    text = (REPO / "README.md").read_text()
    block = re.search(r"^## Command line\n\n```\n(.*?)^```", text, re.M | re.S).group(1)
    assert set(re.findall(r"^rlhf ([a-z-]+)", block, re.M)) == set(_subcommands())
