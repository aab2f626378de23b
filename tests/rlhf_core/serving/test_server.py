"""Blue/green deployment of vLLM's OpenAI-compatible server.

Fast tests (no vLLM server) cover the key, the port choice, the recorded endpoint, stopping a
process group, the key check loaded into the server and the drain gate (in a real uvicorn
server). The slow tests run one real sequence on loopback, because every server start costs
~40 s on two CPU cores:

    deploy v1 -> deploy a v2 vLLM cannot load (fails, v1 keeps serving) -> a deploy SIGKILLed in its
    health wait (its server orphaned) -> deploy v3 under client traffic, through the gateway
    and pinned to v1's own address (stops the orphan, drains and replaces v1, no accepted
    request fails) -> stop

Each stage is a module-scoped fixture that depends on the one before, and the tests of a
stage come before those of the next in this file, so a stage's live checks run while its
server serves. The policy is a tiny Llama with random weights (head size 32, the smallest
vLLM's CPU attention supports): the tests check plumbing, not answers.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil
import pytest
from safetensors.torch import load_file, save_file

from rlhf_core import vllm_scratch
from rlhf_core.config import ServingConfig
from rlhf_core.data.synthetic import answer_for, prompt_for
from rlhf_core.serving import drain as drain_module
from rlhf_core.serving.drain import DrainGate, drain, may_stop
from rlhf_core.serving.server import (
    SERVER_MODULE,
    SERVER_PREFILL_TOKENS,
    Endpoint,
    RequireApiKey,
    ServingError,
    complete,
    current_endpoint,
    deploy,
    health,
    list_models,
    next_port,
    resolve_api_key,
    server_command,
    state_dir_for,
    stop,
    stop_process_group,
)
from rlhf_core.testing.models import POLICY, tiny_policy_dir

KEY_ENV = "RLHF_TEST_SERVING_API_KEY"  # never set by the slow tests: the key comes from the state dir


def servers_on(port: int) -> list[int]:
    """Pids of vLLM API servers started with `--port port`."""
    pids = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        args = proc.info["cmdline"] or []
        if proc.info["status"] != psutil.STATUS_ZOMBIE and SERVER_MODULE in args and f"{port}" in args:
            pids.append(proc.pid)
    return pids


def group_members(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of a process group."""
    members = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except ProcessLookupError:
            pass
    return members


def group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))


def refuses_connections(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def endpoint(pid: int = 1, port: int = 8100) -> Endpoint:
    return Endpoint(
        url=f"http://127.0.0.1:{port}", host="127.0.0.1", port=port, pid=pid, served_model_name="policy-v1",
        version="1", model_dir="/m", log_path="/l", started_at="2024-01-01T00:00:00+00:00",
    )


# --- fast: key, ports, recorded endpoint ---------------------------------------------------


def test_api_key_from_the_environment_wins(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "from-env")
    assert resolve_api_key(ServingConfig(api_key_env=KEY_ENV), tmp_path) == "from-env"
    assert not (tmp_path / "api_key").exists()


@pytest.mark.parametrize(("bind", "outside", "expected"), [
    ("nobind", None, "0"),  # the model in the engine-core process: no worker process to import vLLM again
    ("nobind", "1", "1"),  # a setting made outside wins
    ("0-3", None, None),  # a binding keeps vLLM's worker process, where its threads are set up
])
def test_the_servers_environment_says_where_the_model_runs(tmp_path, monkeypatch, bind, outside, expected):
    from rlhf_core.serving import process

    started = {}
    proc = SimpleNamespace(pid=os.getpid())

    def popen(cmd, **kwargs):
        started.update(cmd=cmd, env=kwargs["env"])
        return proc

    monkeypatch.setattr(process.subprocess, "Popen", popen)
    if outside is None:
        monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", outside)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    cfg = ServingConfig(cpu_threads_bind=bind)
    assert process.launch(tmp_path / "m", "policy-v1", 8100, 64, cfg, "k", tmp_path / "logs" / "s.log") is proc
    env = started["env"]
    assert env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == expected
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == bind and env["VLLM_API_KEY"] == "k"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # it would override --kv-cache-memory-bytes
    # vLLM's sockets and temp files go to a directory of the server's own, which names it
    scratch = Path(env["VLLM_RPC_BASE_PATH"])
    try:
        assert env["TMPDIR"] == str(scratch) and scratch.parent == vllm_scratch.root()
        assert (scratch / vllm_scratch.OWNER).read_text().split(":")[1] == str(proc.pid)
    finally:
        vllm_scratch.remove(scratch)


def test_a_launch_that_fails_leaves_no_directory_and_an_outside_rpc_path_wins(tmp_path, monkeypatch):
    from rlhf_core.serving import process

    made = tmp_path / "scratch"

    def new_dir():
        made.mkdir()
        return made

    monkeypatch.setattr(process.vllm_scratch, "new_dir", new_dir)

    def popen(cmd, **kwargs):
        raise OSError("no such program")

    monkeypatch.setattr(process.subprocess, "Popen", popen)
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    with pytest.raises(OSError, match="no such program"):
        process.launch(tmp_path / "m", "policy-v1", 8100, 64, ServingConfig(), "k", tmp_path / "s.log")
    assert not made.exists()

    started = {}
    monkeypatch.setattr(process.subprocess, "Popen", lambda cmd, **kwargs: started.update(kwargs["env"]))
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/run/vllm")
    process.launch(tmp_path / "m", "policy-v1", 8100, 64, ServingConfig(), "k", tmp_path / "s.log")
    assert started["VLLM_RPC_BASE_PATH"] == "/run/vllm" and started.get("TMPDIR") == os.environ.get("TMPDIR")
    assert not made.exists()  # none made for it


def test_api_key_is_generated_once_with_mode_600(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "")  # empty counts as unset
    cfg = ServingConfig(api_key_env=KEY_ENV)
    key = resolve_api_key(cfg, tmp_path / "serving")
    path = tmp_path / "serving" / "api_key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(key) >= 40 and path.read_text().strip() == key
    assert resolve_api_key(cfg, tmp_path / "serving") == key
    assert [p.name for p in path.parent.iterdir()] == ["api_key"]  # no temporary file left


def test_state_dir_defaults_to_the_output_dir(tmp_path):
    assert state_dir_for(ServingConfig(), tmp_path) == tmp_path / "serving"
    assert state_dir_for(ServingConfig(state_dir=tmp_path / "elsewhere"), tmp_path) == tmp_path / "elsewhere"


def test_blue_green_port_choice():
    ports = (8100, 8101)
    assert next_port(ports, None) == 8100
    assert next_port(ports, endpoint(port=8100)) == 8101
    assert next_port(ports, endpoint(port=8101)) == 8100
    assert next_port(ports, endpoint(port=9000)) == 8100  # the ports were reconfigured


def test_endpoint_round_trips_through_json():
    ep = endpoint()
    assert Endpoint.from_dict(json.loads(json.dumps(ep.to_dict()))) == ep


def test_current_endpoint_is_none_without_a_record(tmp_path):
    assert current_endpoint(tmp_path) is None


def test_current_endpoint_with_a_dead_pid_is_none_and_says_so(tmp_path, caplog):
    proc = subprocess.Popen(["true"])
    proc.wait()
    (tmp_path / "current.json").write_text(json.dumps(endpoint(pid=proc.pid).to_dict()))
    assert current_endpoint(tmp_path) is None
    assert "no longer running" in caplog.text


def test_current_endpoint_ignores_a_live_pid_that_is_not_the_server(tmp_path):
    # After a reboot the recorded pid may belong to anything: never treat it as the server.
    (tmp_path / "current.json").write_text(json.dumps(endpoint(pid=os.getpid()).to_dict()))
    assert current_endpoint(tmp_path) is None


def test_deploy_fails_before_starting_anything_when_the_port_is_taken(tmp_path, free_ports):
    port, other = free_ports(2)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with pytest.raises(ServingError, match=f"port {port} .* in use"):
            deploy(tmp_path / "model", "1", ServingConfig(ports=(port, other), api_key_env=KEY_ENV), tmp_path / "s")
    assert not (tmp_path / "s" / "logs").exists()
    assert not (tmp_path / "s" / "deployments.jsonl").exists()


def test_deploy_needs_a_max_model_len(tmp_path, free_ports):
    (tmp_path / "model").mkdir()
    cfg = ServingConfig(ports=tuple(free_ports(2)), api_key_env=KEY_ENV)
    with pytest.raises(ServingError, match="max_position_embeddings"):
        deploy(tmp_path / "model", "1", cfg, tmp_path / "s")


def test_weights_that_do_not_read_are_refused_before_anything_starts(tmp_path, free_ports):
    """A corrupt copy fails in milliseconds with the file named, not 30 s into a vLLM start;
    the state directory is not even created (nothing to record, nothing to stop)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(random.Random(1).randbytes(4096))
    cfg = ServingConfig(ports=tuple(free_ports(2)), api_key_env=KEY_ENV)
    with pytest.raises(ServingError) as refused:
        deploy(model, "7", cfg, tmp_path / "state")
    assert str(refused.value).startswith("deploy of policy-v7 refused, no server started: ")
    assert f"{model.resolve() / 'model.safetensors'} cannot be read: Error while deserializing header" in str(refused.value)
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize(("chunked", "max_model_len", "expected"), [
    (False, 64, ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048"]),
    (False, 8192, ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192"]),  # one whole prompt a step
    (True, 64, []),  # vLLM on GPU: its own scheduling
])
def test_the_server_splits_no_prompt_unless_chunked_prefill_is_on(chunked, max_model_len, expected):
    cfg = ServingConfig(chunked_prefill=chunked, extra_args=["--seed", "1"])
    cmd = server_command(Path("/m"), "policy-v1", 8100, max_model_len, cfg)
    between = cmd[cmd.index(f"{RequireApiKey.__module__}.RequireApiKey") + 1:cmd.index("--seed")]
    assert between == expected and SERVER_PREFILL_TOKENS == 2048


def test_the_server_of_a_deploy_that_died_is_stopped_and_recorded_by_the_next_one(tmp_path, free_ports):
    """A deploy killed after starting its server leaves `starting.json`; the next deploy (or
    stop) stops every server on that port started from this state directory, and only those."""
    from rlhf_core.serving.server import _stop_abandoned
    from rlhf_core.serving.state import write_json_atomic

    port = free_ports(1)[0]
    logs = tmp_path / "logs"
    logs.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)", SERVER_MODULE, "--port", str(port)]
    ours = subprocess.Popen(sleeper, cwd=logs, start_new_session=True)
    other = subprocess.Popen(sleeper, cwd=elsewhere, start_new_session=True)  # not ours: another checkout's
    try:
        write_json_atomic(tmp_path / "starting.json", endpoint(pid=ours.pid, port=port).to_dict())
        _stop_abandoned(tmp_path)
        assert ours.wait(timeout=30) is not None and other.poll() is None
        assert not (tmp_path / "starting.json").exists()
        [line] = [json.loads(x) for x in (tmp_path / "deployments.jsonl").read_text().splitlines()]
        assert (line["event"], line["stopped_process_groups"]) == ("abandoned", [ours.pid])
        _stop_abandoned(tmp_path)  # nothing left: a no-op
        write_json_atomic(tmp_path / "starting.json", endpoint(pid=0, port=port).to_dict())  # died before launch
        _stop_abandoned(tmp_path)
        assert other.poll() is None and not (tmp_path / "starting.json").exists()
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()


def test_stop_without_a_server_is_a_no_op(tmp_path):
    assert stop(tmp_path / "never-deployed") is None
    assert stop(tmp_path) is None


# --- fast: stopping a process group ----------------------------------------------------------


def detached(script: str) -> subprocess.Popen:
    proc = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    time.sleep(0.3)  # let bash start its child
    return proc


def test_stop_process_group_stops_the_leader_and_its_children():
    proc = detached("sleep 60 & wait")
    assert group_alive(proc.pid)
    start = time.monotonic()
    stop_process_group(proc.pid, timeout=10)
    assert time.monotonic() - start < 5
    assert not group_alive(proc.pid)


def test_stop_process_group_kills_what_ignores_sigterm():
    proc = detached('trap "" TERM; sleep 60 & wait')  # the ignored signal is inherited by sleep
    start = time.monotonic()
    stop_process_group(proc.pid, timeout=1)
    assert 1 <= time.monotonic() - start < 5
    assert not group_alive(proc.pid)


def test_stop_process_group_of_a_gone_process_returns():
    proc = subprocess.Popen(["true"], start_new_session=True)
    proc.wait()
    stop_process_group(proc.pid, timeout=1)


# --- fast: the key check loaded into the server ------------------------------------------


def asgi_status(middleware: RequireApiKey, path: str, authorization: str | None = None) -> int:
    headers = [(b"authorization", authorization.encode())] if authorization is not None else []
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": headers}
    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(middleware(scope, None, send))
    return sent[0]["status"]


async def ok_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def test_require_api_key_guards_every_path_but_health_and_metrics(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "k")
    guard = RequireApiKey(ok_app)
    assert asgi_status(guard, "/invocations") == 401
    assert asgi_status(guard, "/invocations", "Bearer wrong") == 401
    assert asgi_status(guard, "/invocations", "Basic k") == 401
    assert asgi_status(guard, "/invocations", "Bearer k") == 200
    assert asgi_status(guard, "/v1/completions", "Bearer k") == 200
    assert asgi_status(guard, "/health") == 200
    assert asgi_status(guard, "/metrics") == 200


def test_require_api_key_fails_closed_without_a_key(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    guard = RequireApiKey(ok_app)
    assert asgi_status(guard, "/invocations", "Bearer ") == 401
    assert asgi_status(guard, "/health") == 200


# --- fast: the drain gate ------------------------------------------------------------------


@pytest.mark.parametrize(("in_flight", "connections", "elapsed_s", "timeout_s", "expected"), [
    (0, 0, 0.0, 30.0, True),  # nothing accepted, nothing open: stop now
    (1, 1, 0.0, 30.0, False),  # a request is being answered
    (0, 1, 5.0, 30.0, False),  # all answered, but a client may still send on its open connection
    (0.0, 0, 1.0, 30.0, True),  # vLLM's /metrics count (a float) of a server without the gate
    (2, 2, 30.0, 30.0, True),  # the timeout: stop anyway (what is left is aborted)
    (1, 1, 0.0, 0.0, True),  # drain_timeout_s 0: no wait
])
def test_may_stop_once_nothing_is_in_flight_and_no_connection_is_open_or_at_the_timeout(
        in_flight, connections, elapsed_s, timeout_s, expected):
    assert may_stop(in_flight, connections, elapsed_s, timeout_s) is expected


def test_the_drain_gate_sits_inside_the_key_check():
    """vLLM adds `--middleware` classes in order, the last outermost: RequireApiKey must come
    after DrainGate, or anyone could POST /drain."""
    cmd = server_command(Path("/m"), "policy-v1", 8100, 64, ServingConfig())
    given = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--middleware"]
    assert given == [f"{DrainGate.__module__}.DrainGate", f"{RequireApiKey.__module__}.RequireApiKey"]


def served_app(middlewares: list[str]):
    """A Starlette app with a slow (3 s) and a fast route and `middlewares` added the way vLLM adds
    `--middleware` (`vllm/entrypoints/serve/middleware/register.py`)."""
    import importlib

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    async def slow(request):
        await asyncio.sleep(3)
        return JSONResponse({"ok": True})

    async def fast(request):
        return JSONResponse({"ok": True})

    async def metrics(request):
        return PlainTextResponse("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n")

    app = Starlette(routes=[Route("/slow", slow, methods=["POST"]), Route("/fast", fast), Route("/metrics", metrics)])
    for name in middlewares:
        module, cls = name.rsplit(".", 1)
        app.add_middleware(getattr(importlib.import_module(module), cls))
    return app


@contextmanager
def uvicorn_serving(app):
    """`app` served by uvicorn (uvloop, keep-alive 5 s) on a socket bound beforehand and kept in
    `app.state.server`, as vLLM's launcher serves its app; its URL."""
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=5))
    app.state.server = server
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def refuses_new_connections(url: str, within_s: float) -> bool:
    """Does the server at `url` refuse a new connection within `within_s`? Asks /metrics, which
    the gate neither counts nor refuses on an open connection. A connection accepted as the
    listener closes and then reset, unanswered, is refused too."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/metrics", timeout=1, trust_env=False)
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            return True
        time.sleep(0.05)
    return False


def test_a_drained_server_refuses_new_requests_and_answers_those_it_accepted(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "k")
    monkeypatch.setattr(drain_module, "DRAIN_GRACE_S", 0.2)
    cmd = server_command(Path("/m"), "policy-v1", 8100, 64, ServingConfig())
    app = served_app([cmd[i + 1] for i, a in enumerate(cmd) if a == "--middleware"])
    auth = {"Authorization": "Bearer k"}
    with uvicorn_serving(app) as url, ThreadPoolExecutor(2) as pool, \
            httpx.Client(trust_env=False, timeout=10, headers=auth) as kept:
        with httpx.Client(trust_env=False, timeout=10) as other:
            assert other.post(f"{url}/drain?timeout=1").status_code == 401  # the key guards the gate
            assert other.get(f"{url}/drain?timeout=1", headers=auth).status_code == 405
        assert kept.get(f"{url}/fast").status_code == 200  # a keep-alive connection, idle from now on

        def timed_slow():
            with httpx.Client(trust_env=False, timeout=10, headers=auth) as client:
                start = time.time()
                r = client.post(f"{url}/slow")
                return r, start, time.time()

        slow = pool.submit(timed_slow)
        time.sleep(0.3)  # the slow request is in flight
        drained = pool.submit(drain, url, "k", 10.0)
        assert refuses_new_connections(url, within_s=2), "the drained server still accepts connections"
        refused = kept.get(f"{url}/fast")  # a request on an open connection: 503, and the connection closes
        assert (refused.status_code, refused.headers["connection"]) == (503, "close")
        assert not drained.done()  # the slow request is not answered yet

        r, started, ended = slow.result(timeout=10)
        result = drained.result(timeout=10)
    assert (r.status_code, r.json(), r.headers["connection"]) == (200, {"ok": True}, "close")
    assert result.gated and (result.in_flight_at_close, result.in_flight_left) == (1, 0)
    assert started < result.closed_at < ended  # it was in flight when the server closed
    assert 2 < result.seconds < 5


def test_a_server_without_the_gate_is_drained_by_its_metrics(monkeypatch):
    """A server started before the gate existed: POST /drain is 404, and vLLM's own count of
    running and waiting requests (here 0) decides."""
    monkeypatch.setattr(drain_module, "DRAIN_GRACE_S", 0.0)
    with uvicorn_serving(served_app([])) as url:
        result = drain(url, None, 5.0)
    assert not result.gated and (result.in_flight_at_close, result.in_flight_left) == (None, 0)
    assert result.seconds < 2


# --- slow: one real blue/green sequence ---------------------------------------------------


@dataclass
class Serving:
    cfg: ServingConfig
    state_dir: Path
    model_dir: Path
    unloadable_dir: Path  # its headers read; one tensor has a name the model does not have

    @property
    def key(self) -> str:
        return (self.state_dir / "api_key").read_text().strip()

    def current_json(self) -> bytes:
        return (self.state_dir / "current.json").read_bytes()

    def history(self) -> list[dict]:
        return [json.loads(line) for line in (self.state_dir / "deployments.jsonl").read_text().splitlines()]


def scratch_owned_by(pids: list[int]) -> list[Path]:
    """The vLLM scratch directories (rlhf_core.vllm_scratch) whose owner is one of `pids`."""
    owned = []
    for path in vllm_scratch.root().glob(f"{vllm_scratch.PREFIX}*"):
        with contextlib.suppress(OSError):
            if int((path / vllm_scratch.OWNER).read_text().split(":")[1]) in pids:
                owned.append(path)
    return owned


@pytest.fixture(scope="module")
def serving(tmp_path_factory, free_ports) -> Serving:
    tmp = tmp_path_factory.mktemp("serving")
    model_dir = tiny_policy_dir(tmp / "policy")
    unloadable_dir = tmp / "unloadable"  # a checkpoint of another model version, say
    shutil.copytree(model_dir, unloadable_dir)
    tensors = load_file(unloadable_dir / "model.safetensors")
    tensors["model.layers.0.mlp.wrong_name.weight"] = tensors.pop("model.layers.0.mlp.gate_proj.weight")
    save_file(tensors, unloadable_dir / "model.safetensors", metadata={"format": "pt"})
    cfg = ServingConfig(
        ports=tuple(free_ports(2)), api_key_env=KEY_ENV, smoke_prompt="12+34=", kv_cache_gib=0.25, startup_timeout_s=300
    )
    os.environ.pop(KEY_ENV, None)
    yield Serving(cfg, tmp / "state", model_dir, unloadable_dir)
    for port in cfg.ports:  # whatever a failed test left behind
        for pid in servers_on(port):
            stop_process_group(pid)


@pytest.fixture(scope="module")
def v1(serving):
    return deploy(serving.model_dir, "1", serving.cfg, serving.state_dir)


@pytest.fixture(scope="module")
def failed_v2(serving, v1):
    before = serving.current_json()
    with pytest.raises(ServingError) as failure:
        deploy(serving.unloadable_dir, "2", serving.cfg, serving.state_dir)
    return failure.value, before


DEPLOY_SCRIPT = """
import sys
from pathlib import Path
from rlhf_core.config import ServingConfig
from rlhf_core.serving.server import deploy
deploy(Path(sys.argv[2]), "2k", ServingConfig.model_validate_json(sys.argv[1]), Path(sys.argv[3]))
"""


@pytest.fixture(scope="module")
def killed_deploy(serving, failed_v2):
    """A deploy SIGKILLed while it waits for its new server's /health: the server, detached,
    lives on (an orphan on the next port) with only the deploy's intent record to find it."""
    repo = Path(__file__).resolve().parents[3]
    proc = subprocess.Popen([sys.executable, "-c", DEPLOY_SCRIPT, serving.cfg.model_dump_json(), str(serving.model_dir),
                             str(serving.state_dir)], cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    starting = serving.state_dir / "starting.json"
    deadline = time.monotonic() + 120
    while not (starting.exists() and json.loads(starting.read_text())["pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    orphan = json.loads(starting.read_text())["pid"]
    time.sleep(5)  # vLLM has started its engine process by now: the whole group must go
    assert proc.poll() is None and not health(f"http://127.0.0.1:{serving.cfg.ports[1]}"), "killed too late"
    proc.kill()
    proc.wait()
    return orphan


@dataclass
class Call:
    """One request of a client pinned to the old server's own address."""

    kind: str  # "long": a stream of LONG_TOKENS tokens (ignore_eos); "short": 2 tokens, not streamed
    started: float  # unix time
    ended: float
    outcome: str  # "answered"; "refused" before accept (connect error or 503); anything else "dropped"
    detail: str = ""


LONG_TOKENS = 48  # with the prompt, within the tiny policy's 64 positions


@dataclass
class UnderTraffic:
    result: object  # the DeployResult
    responses: list[tuple[int, str]]  # (status, served model) of every client request, in order
    during: int  # how many were sent while the deploy ran
    pinned: list[Call]  # the requests sent to v1's own address, which does not follow current.json


def _clients(gateway: str, key: str, stop_at: list[float], out: list[tuple[int, str]]) -> None:
    with httpx.Client(timeout=60, trust_env=False, headers={"Authorization": f"Bearer {key}"}) as client:
        while time.monotonic() < stop_at[0]:
            r = client.post(f"{gateway}/v1/completions",
                            json={"model": "policy", "prompt": "12+34=", "max_tokens": 2, "temperature": 0})
            out.append((r.status_code, r.json().get("model", "") if r.status_code == 200 else r.text[:200]))
            # a few requests a second each: flat out, two clients kept v1 and the gateway busy
            # on a core that the new server's start needs, and the switch is what matters
            time.sleep(0.25)


def _outcome(r: httpx.Response, stream: bool) -> tuple[str, str]:
    """A response's outcome: answered only with every token it asked for and no error."""
    if r.status_code == 503:
        return "refused", "503"
    if r.status_code != 200:
        return "dropped", f"HTTP {r.status_code}: {r.text[:200]}"
    if not stream:
        reason = r.json()["choices"][0]["finish_reason"]
        return ("answered", "") if reason in ("length", "stop") else ("dropped", f"finish_reason {reason}")
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    reasons = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    if events[-1:] != ["[DONE]"] or any("error" in c for c in chunks) or [r for r in reasons if r] != ["length"]:
        return "dropped", f"stream ended {events[-2:]}"
    return "answered", ""


def _pinned(url: str, key: str, model: str, kind: str, stop_at: list[float], out: list[Call]) -> None:
    """Requests to one server's own address, one after another, as a client that does not
    follow current.json sends them."""
    long = kind == "long"
    body = {"model": model, "prompt": "12+34=", "temperature": 0, "max_tokens": LONG_TOKENS if long else 2,
            "ignore_eos": long, "stream": long}
    with httpx.Client(timeout=120, trust_env=False, headers={"Authorization": f"Bearer {key}"}) as client:
        while time.monotonic() < stop_at[0]:
            started = time.time()
            try:
                with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                    r.read()
                outcome, detail = _outcome(r, long)
            except httpx.ConnectError as e:  # refused: it accepts no connection
                outcome, detail = "refused", repr(e)
            except httpx.HTTPError as e:  # reset or cut off after it accepted the request
                outcome, detail = "dropped", repr(e)
            out.append(Call(kind, started, time.time(), outcome, detail))
            if outcome == "refused":
                time.sleep(0.05)


@pytest.fixture(scope="module")
def v3_under_traffic(serving, v1, killed_deploy, free_ports, tmp_path_factory):
    """v3 deployed while two clients call the served model through the feedback gateway
    (which follows current.json) a few times a second, before, during and after the switch,
    and three more send to v1's own address throughout: two stream long completions back to
    back (so that some are in flight when v1 is drained), one asks for short ones."""
    from rlhf_core.testing.gateway_process import running_gateway

    port = free_ports(1)[0]
    args = ["--set", f"output_dir={tmp_path_factory.mktemp('gateway')}", "--set", f"serving.state_dir={serving.state_dir}",
            "--set", f"feedback.port={port}"]
    responses: list[tuple[int, str]] = []
    pinned: list[Call] = []
    old = v1.endpoint
    with running_gateway(args, port) as gateway:
        stop_at = [float("inf")]
        threads = [threading.Thread(target=_clients, args=(gateway, serving.key, stop_at, responses)) for _ in range(2)]
        threads += [threading.Thread(target=_pinned, args=(old.url, serving.key, old.served_model_name, kind, stop_at,
                                                           pinned)) for kind in ("long", "long", "short")]
        for t in threads:
            t.start()
        time.sleep(3)
        before = len(responses)
        try:
            result = deploy(serving.model_dir, "3", serving.cfg, serving.state_dir)
        finally:
            during = len(responses) - before
            stop_at[0] = time.monotonic() + 3
            for t in threads:
                t.join()
    return UnderTraffic(result, responses, during, pinned)


@pytest.fixture(scope="module")
def v3(v3_under_traffic):
    return v3_under_traffic.result


@pytest.mark.slow
def test_v1_serves_on_the_first_port_and_is_recorded(serving, v1):
    ep = v1.endpoint
    assert (ep.served_model_name, ep.version, ep.port) == ("policy-v1", "1", serving.cfg.ports[0])
    assert v1.previous is None
    assert isinstance(v1.smoke_completion, str)
    assert current_endpoint(serving.state_dir) == ep
    assert json.loads(serving.current_json()) == ep.to_dict()
    assert [(h["event"], h["endpoint"]["version"]) for h in serving.history()] == [("deployed", "1")]
    print(f"v1 healthy and smoke-tested in {v1.seconds:.1f} s")


@pytest.mark.slow
def test_v1_answers_with_the_key(serving, v1):
    url = v1.endpoint.url
    assert health(url)
    assert list_models(url, serving.key) == ["policy-v1"]
    assert complete(url, serving.key, "policy-v1", "12+34=", max_tokens=4) == complete(
        url, serving.key, "policy-v1", "12+34=", max_tokens=4
    )  # greedy


@pytest.mark.slow
def test_v1_answers_seeded_requests_for_more_prompt_tokens_than_a_step_takes(serving, v1):
    """4 requests at once of 64 seeded samples of a 43-token prompt: far more prompt tokens
    than vLLM's CPU server takes in a step (2,048). With chunked prefill vLLM split a sample's
    prompt across two steps, and sampling that seeded request killed the engine ("CPU
    Generator does not use offset"): 500 for these and every later request."""
    from transformers import PreTrainedTokenizerFast

    prompt = "".join(prompt_for(a, b, 2) + answer_for(a + b, 2) for a, b in [(12, 34), (56, 78), (90, 11), (23, 45)])
    prompt += prompt_for(67, 89, 2)
    tokens = len(PreTrainedTokenizerFast.from_pretrained(serving.model_dir)(prompt)["input_ids"])
    assert 64 * tokens > SERVER_PREFILL_TOKENS and tokens + 2 <= POLICY.max_position_embeddings, tokens

    async def seeded(client: httpx.AsyncClient, seed: int) -> httpx.Response:
        body = {"model": "policy-v1", "prompt": prompt, "max_tokens": 2, "n": 64, "temperature": 1.0, "seed": seed}
        return await client.post(f"{v1.endpoint.url}/v1/completions", json=body)

    async def at_once() -> list[httpx.Response]:
        headers = {"Authorization": f"Bearer {serving.key}"}
        async with httpx.AsyncClient(headers=headers, timeout=120) as client:
            return await asyncio.gather(*(seeded(client, seed) for seed in range(4)))

    responses = asyncio.run(at_once())
    assert [r.status_code for r in responses] == [200] * 4, responses[0].text
    assert all(len(r.json()["choices"]) == 64 for r in responses)
    assert health(v1.endpoint.url)


@pytest.mark.slow
def test_v1_refuses_requests_without_the_right_key(serving, v1):
    url = v1.endpoint.url
    body = {"model": "policy-v1", "prompt": "12+34=", "max_tokens": 2}
    with httpx.Client(trust_env=False, timeout=30) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            assert client.get(f"{url}/v1/models", headers=headers).status_code == 401
            assert client.post(f"{url}/v1/completions", headers=headers, json=body).status_code == 401
            # vLLM's own key check skips SageMaker's /invocations; RequireApiKey does not
            assert client.post(f"{url}/invocations", headers=headers, json=body).status_code == 401
        assert client.get(f"{url}/health").status_code == 200
        assert client.get(f"{url}/metrics").status_code == 200
        authorised = {"Authorization": f"Bearer {serving.key}"}
        assert client.post(f"{url}/invocations", headers=authorised, json=body).status_code == 200
    with pytest.raises(ServingError, match="401"):
        list_models(url, "wrong")


@pytest.mark.slow
def test_v1_is_detached_and_its_key_is_in_neither_ps_nor_the_log(serving, v1):
    pid = v1.endpoint.pid
    assert os.getpgid(pid) == pid and os.getsid(pid) == pid != os.getsid(0)
    assert stat.S_IMODE((serving.state_dir / "api_key").stat().st_mode) == 0o600
    group = group_members(pid)
    assert len(group) >= 2  # the API server and vLLM's engine core
    # nobind (the default): the model runs in the engine core, no worker process beside it
    assert not [p for p in group if p.name().startswith("VLLM::Worker")], [p.name() for p in group]
    for proc in group:
        assert serving.key not in " ".join(proc.cmdline())
    assert serving.key not in Path(v1.endpoint.log_path).read_text(errors="replace")
    # vLLM's sockets are in the server's own directory, which names it, not in the temp directory
    scratch = Path(psutil.Process(pid).environ()["VLLM_RPC_BASE_PATH"])
    assert scratch.parent == vllm_scratch.root() and scratch.name.startswith(vllm_scratch.PREFIX)
    assert (scratch / vllm_scratch.OWNER).read_text().split(":")[1] == str(pid)
    assert [p for p in scratch.iterdir() if stat.S_ISSOCK(p.lstat().st_mode)], list(scratch.iterdir())


@pytest.mark.slow
def test_v1_and_its_engine_listen_on_loopback_only(serving, v1):
    """Every socket the server's processes (API server, engine core, workers) listen on is the
    configured host's (127.0.0.1 by default): nothing is reachable from another machine."""
    import ipaddress

    listening = {f"{c.laddr.ip}:{c.laddr.port}" for proc in group_members(v1.endpoint.pid)
                 for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    assert f"127.0.0.1:{v1.endpoint.port}" in listening
    assert all(ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback for a in listening), listening


@pytest.mark.slow
def test_a_model_vllm_cannot_load_fails_with_the_cause(serving, failed_v2):
    error, _ = failed_v2
    message = str(error)
    assert "policy-v2" in message
    assert "exited with code" in message
    # the root cause, logged by the engine core far above the tail
    assert "There is no module or parameter named 'layers.0.mlp.wrong_name'" in message
    assert "last 20 lines" in message


@pytest.mark.slow
def test_after_a_failed_deploy_v1_still_serves_and_nothing_is_left(serving, v1, failed_v2):
    _, before = failed_v2
    assert serving.current_json() == before
    assert current_endpoint(serving.state_dir) == v1.endpoint
    assert list_models(v1.endpoint.url, serving.key) == ["policy-v1"]
    assert complete(v1.endpoint.url, serving.key, "policy-v1", "12+34=") == v1.smoke_completion
    other = serving.cfg.ports[1]
    assert servers_on(other) == [] and refuses_connections(other)
    history = serving.history()
    assert [h["event"] for h in history] == ["deployed", "failed"]
    assert "no module or parameter named 'layers.0.mlp.wrong_name'" in history[-1]["cause"]


@pytest.mark.slow
def test_a_deploy_killed_in_its_health_wait_leaves_an_orphan_the_next_deploy_stops(serving, killed_deploy, v3):
    assert not group_alive(killed_deploy)
    assert not (serving.state_dir / "starting.json").exists()
    events = [(h["event"], h["endpoint"]["version"]) for h in serving.history()]
    assert events == [("deployed", "1"), ("failed", "2"), ("abandoned", "2k"), ("deployed", "3")]
    assert serving.history()[2]["stopped_process_groups"] == [killed_deploy]
    assert servers_on(serving.cfg.ports[1]) == [v3.endpoint.pid]


@pytest.mark.slow
def test_a_deploy_under_traffic_succeeds_and_no_request_fails_across_the_switch(v3_under_traffic):
    responses = v3_under_traffic.responses
    failed = [r for r in responses if r[0] != 200]
    assert failed == [], f"{len(failed)} of {len(responses)} requests failed: {failed[:3]}"
    served = [model for _, model in responses]
    switch = served.index("policy-v3")
    assert set(served[:switch]) == {"policy-v1"} and set(served[switch:]) <= {"policy-v1", "policy-v3"}
    assert v3_under_traffic.during >= 20, "the clients hardly ran during the deploy"
    print(f"{len(responses)} requests, {v3_under_traffic.during} during the deploy "
          f"({v3_under_traffic.result.seconds:.0f} s), none failed")


@pytest.mark.slow
def test_a_client_pinned_to_the_old_server_has_no_accepted_request_dropped(v3_under_traffic):
    """v1 is drained: it stops taking requests (503 or a refused connection, both fine: the
    client may go elsewhere) and answers every request it accepted before it is stopped. The
    server's own count and the client's timestamps both show requests in flight at that moment."""
    calls, drained = v3_under_traffic.pinned, v3_under_traffic.result.drained
    dropped = [c for c in calls if c.outcome == "dropped"]
    assert dropped == [], f"{len(dropped)} of {len(calls)} accepted requests were dropped: {dropped[:3]}"
    assert drained.gated and drained.in_flight_left == 0
    closed = drained.closed_at
    in_flight = [c for c in calls if c.outcome == "answered" and c.started < closed < c.ended]
    assert drained.in_flight_at_close >= 1 and in_flight, "no request was in flight when v1 closed: nothing was tested"
    assert not [c for c in calls if c.outcome == "answered" and c.started > closed], "v1 took requests after it closed"
    refused = [c for c in calls if c.outcome == "refused"]
    assert refused and min(c.started for c in refused) > closed - 1, "the pinned clients were refused before the drain"
    long_ = [c for c in calls if c.kind == "long" and c.outcome == "answered"]
    print(f"pinned to v1: {len(calls)} requests, {len(long_)} long streams answered; at the close "
          f"{drained.in_flight_at_close} in flight by v1's count, {len(in_flight)} by the clients' clocks "
          f"({sum(c.kind == 'long' for c in in_flight)} long), all answered; {len(refused)} refused after; "
          f"drain {drained.seconds:.1f} s")


@pytest.mark.slow
def test_v3_replaces_v1_on_the_other_port(serving, v1, v3):
    assert v3.previous == v1.endpoint
    assert (v3.endpoint.served_model_name, v3.endpoint.port) == ("policy-v3", serving.cfg.ports[1])
    assert current_endpoint(serving.state_dir) == v3.endpoint
    assert list_models(v3.endpoint.url, serving.key) == ["policy-v3"]
    assert v3.smoke_completion == v1.smoke_completion  # same weights, greedy
    with pytest.raises(ServingError, match="404"):
        complete(v3.endpoint.url, serving.key, "policy-v1", "12+34=")
    assert not group_alive(v1.endpoint.pid)
    assert refuses_connections(v1.endpoint.port)
    last = serving.history()[-1]
    assert (last["event"], last["endpoint"]["version"], last["replaced"]["version"]) == ("deployed", "3", "1")
    print(f"v3 healthy and smoke-tested in {v3.seconds:.1f} s (v1 serving meanwhile)")


@pytest.mark.slow
def test_an_llm_judge_labels_a_round_through_the_server_and_skips_what_it_cannot_read(serving, v3, monkeypatch):
    """The llm_judge annotator against the real OpenAI-compatible server (with its API key).
    The served model is a random tiny Llama, so reference-guided judging is what can label:
    the judge's own greedy answer is the reference, and the answer equal to it is preferred.
    Asked for a [[A]]/[[B]] verdict, the same model says something else: every reply is
    counted malformed and none becomes a label."""
    from rlhf_core.config import JudgeConfig
    from rlhf_core.training.preference_rounds import Item, JudgeAnnotator

    monkeypatch.setenv("RLHF_TEST_JUDGE_KEY", serving.key)
    url, model = v3.endpoint.url, v3.endpoint.served_model_name
    prompts = ["12+34=", "07+48=", "55+05=", "90+09="]
    own = [complete(url, serving.key, model, p, max_tokens=4).strip().splitlines()[0] for p in prompts]
    items = [Item(p, o, o + "9") if k % 2 == 0 else Item(p, o + "9", o) for k, (p, o) in enumerate(zip(prompts, own))]
    judge = JudgeConfig(base_url=f"{url}/v1", model=model, api_key_env="RLHF_TEST_JUDGE_KEY", template="{prompt}",
                        parser="match_answer", max_tokens=4)
    out = JudgeAnnotator(judge).annotate(items, "round-test")
    assert out.counts["asked"] == 4 and out.counts["labelled"] == 4
    assert [p["chosen"] for p in out.pairs] == own

    verdicts = JudgeAnnotator(judge.model_copy(update={"parser": "verdict"}))
    out = verdicts.annotate(items, "round-test")  # digits where a verdict should be
    assert out.pairs == [] and out.counts["asked"] == 4
    assert out.counts["malformed"] + out.counts["refused"] == 4 and out.counts["error"] == 0

    # the default template is longer than this model's context: the server refuses each request
    long = JudgeAnnotator(judge.model_copy(update={"parser": "verdict", "template": JudgeConfig().template}))
    out = long.annotate(items, "round-test")
    assert out.pairs == [] and out.counts["error"] == 4

    monkeypatch.setenv("RLHF_TEST_JUDGE_KEY", "wrong-key")
    out = JudgeAnnotator(judge).annotate(items[:1], "round-test")
    assert out.pairs == [] and out.counts["error"] == 1  # 401: a failed request, not a label


@pytest.mark.slow
def test_stop_leaves_no_server(serving, v1, killed_deploy, v3):
    assert scratch_owned_by([v3.endpoint.pid])  # v3 serves
    assert stop(serving.state_dir) == v3.endpoint
    # nor a directory of vLLM's files of any server this module started, stopped or killed
    assert scratch_owned_by([v1.endpoint.pid, killed_deploy, v3.endpoint.pid]) == []
    assert not (serving.state_dir / "current.json").exists()
    assert current_endpoint(serving.state_dir) is None
    assert not group_alive(v3.endpoint.pid)
    for port in serving.cfg.ports:
        assert servers_on(port) == [] and refuses_connections(port)
    assert stop(serving.state_dir) is None
