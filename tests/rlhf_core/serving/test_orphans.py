"""What a vLLM server killed alone leaves behind (its engine processes, still in its process
group, one of them on a loopback port), found and ended by `rlhf serving status/stop` and by
the next deploy; and what is not ours, left alone.

The process groups here are real and shaped like the server's: a leader started with
`start_new_session=True` (the server's command line), a child that listens on a port and one
that sleeps, both in the leader's group. No vLLM."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from flows.cli import main
from rlhf_core.config import ServingConfig
from rlhf_core.serving import server
from rlhf_core.serving.orphans import Proc, end_server, orphaned, server_processes
from rlhf_core.serving.server import SERVER_MODULE, Endpoint
from rlhf_core.serving.state import write_json_atomic

LISTEN = """
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
time.sleep(300)
"""

LEADER = f"""
import subprocess, sys, time
listener = subprocess.Popen([sys.executable, "-c", {LISTEN!r}, sys.argv[-1]], stdout=subprocess.PIPE)
listener.stdout.readline()
sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(listener.pid, sleeper.pid, flush=True)
time.sleep(300)
"""


@dataclass
class Group:
    leader: subprocess.Popen
    children: list[int]  # [the listener, the sleeper]


def start_group(port: int) -> Group:
    """A process group like a vLLM server's, its listener on `port`."""
    leader = subprocess.Popen([sys.executable, "-c", LEADER, SERVER_MODULE, "--port", str(port)],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    return Group(leader, [int(pid) for pid in leader.stdout.readline().split()])


def kill_leader(group: Group) -> None:
    group.leader.kill()
    group.leader.wait()


def start_unrelated(port: int) -> subprocess.Popen:
    """Someone else's server on `port`, in a session of its own."""
    proc = subprocess.Popen([sys.executable, "-c", LISTEN, str(port)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout.readline() == "listening\n"
    return proc


def cleanup(group: Group | None, *others: subprocess.Popen) -> None:
    if group is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group.leader.pid, signal.SIGKILL)
        for pid in group.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        group.leader.kill()
        group.leader.wait()
    for proc in others:
        proc.kill()
        proc.wait()


def record(state: Path, pid: int, port: int, version: str = "3") -> Endpoint:
    """current.json as a deploy writes it."""
    state.mkdir(parents=True, exist_ok=True)
    endpoint = Endpoint(url=f"http://127.0.0.1:{port}", host="127.0.0.1", port=port, pid=pid,
                        served_model_name=f"policy-v{version}", version=version,
                        model_dir=str(state / "models" / version), log_path=str(state / "logs" / f"v{version}.log"),
                        started_at="2024-01-01T00:00:00+00:00")
    write_json_atomic(state / "current.json", endpoint.to_dict())
    return endpoint


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # re-parented: its reaper may be slow
    except psutil.NoSuchProcess:
        return True


def accepts_connections(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def serving(action: str, state: Path) -> list[str]:
    return ["serving", action, "--set", f"serving.state_dir={state}"]


# --- fast: real process groups through `rlhf serving status/stop` and a deploy ----------------


def test_status_names_the_orphans_of_a_server_killed_alone_and_stop_ends_them(tmp_path, capsys, free_ports):
    port = free_ports(1)[0]
    state, group = tmp_path / "serving", None
    try:
        group = start_group(port)
        record(state, group.leader.pid, port)
        kill_leader(group)
        assert not any(gone(pid) for pid in group.children) and accepts_connections(port)
        pids = ", ".join(map(str, sorted(group.children)))

        assert main(serving("status", state)) == 1
        assert capsys.readouterr().out == (
            f"nothing is serving; 2 orphaned processes of the last server (pids {pids}, pgid {group.leader.pid}) "
            "still run: `rlhf serving stop` ends them\n")
        assert main(serving("stop", state)) == 0
        assert capsys.readouterr().out == (f"ended 2 orphaned processes of the last server, policy v3 (pids {pids}, "
                                           f"pgid {group.leader.pid}); nothing serves now\n")
        assert all(gone(pid) for pid in group.children) and not accepts_connections(port)
        assert not (state / "current.json").exists()
        [line] = [json.loads(x) for x in (state / "deployments.jsonl").read_text().splitlines()]
        assert (line["event"], line["orphans"]) == ("stopped", sorted(group.children))

        assert main(serving("status", state)) == 1
        assert main(serving("stop", state)) == 0
        assert capsys.readouterr().out == "nothing is serving\nnothing was serving\n"
    finally:
        cleanup(group)


def test_stop_leaves_an_unrelated_listener_on_the_recorded_port_alone(tmp_path, capsys, free_ports):
    """Someone else's process listens on the recorded port and another port: it is neither in
    the recorded group nor looks like our server, so only the group's processes end."""
    ours, recorded, other = free_ports(3)
    state, group, unrelated = tmp_path / "serving", None, []
    try:
        group = start_group(ours)
        unrelated = [start_unrelated(recorded), start_unrelated(other)]
        record(state, group.leader.pid, recorded)
        kill_leader(group)

        assert main(serving("status", state)) == 1
        assert f"2 orphaned processes of the last server (pids {', '.join(map(str, sorted(group.children)))}," \
               in capsys.readouterr().out
        assert main(serving("stop", state)) == 0
        assert capsys.readouterr().out.startswith("ended 2 orphaned processes")
        assert all(gone(pid) for pid in group.children)
        assert all(proc.poll() is None for proc in unrelated)
        assert accepts_connections(recorded) and accepts_connections(other)
    finally:
        cleanup(group, *unrelated)


def test_a_deploy_ends_the_orphans_of_the_dead_server_before_it_takes_their_port(tmp_path, free_ports, monkeypatch):
    """The recorded server was killed alone on the first blue/green port; its engine holds the
    port. The next deploy ends them, records it, then starts its server there."""
    ports = tuple(free_ports(2))
    state, group, started = tmp_path / "serving", None, []

    def launch(model_dir, name, port, max_model_len, cfg, api_key, log_path):
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", SERVER_MODULE,
                                         "--port", str(port)], start_new_session=True))
        return started[-1]

    monkeypatch.setattr(server, "launch", launch)
    monkeypatch.setattr(server, "_check_new_server", lambda proc, endpoint, api_key, cfg: "")
    try:
        group = start_group(ports[0])
        record(state, group.leader.pid, ports[0])
        kill_leader(group)
        (tmp_path / "model").mkdir()
        result = server.deploy(tmp_path / "model", "4", ServingConfig(ports=ports, max_model_len=64), state)
        assert result.endpoint.port == ports[0] and result.previous is None
        assert all(gone(pid) for pid in group.children)
        events = [json.loads(x) for x in (state / "deployments.jsonl").read_text().splitlines()]
        assert [(e["event"], e["endpoint"]["version"]) for e in events] == [("stopped", "3"), ("deployed", "4")]
        assert events[0]["orphans"] == sorted(group.children)
        assert server.stop(state) == result.endpoint
    finally:
        cleanup(group, *started)


def test_end_server_kills_orphans_that_ignore_sigterm_after_the_grace(free_ports):
    leader = subprocess.Popen(["bash", "-c", 'trap "" TERM; sleep 300 & echo $!; wait'], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)  # the ignored signal is inherited by sleep
    sleeper = int(leader.stdout.readline())
    try:
        leader.kill()
        leader.wait()
        start = time.monotonic()
        assert end_server(endpoint(leader.pid, free_ports(1)[0]), grace_s=1) == [sleeper]
        assert 1 <= time.monotonic() - start < 10 and gone(sleeper)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(sleeper, signal.SIGKILL)


# --- fast: the decision over a process table ------------------------------------------------

ME = (100, 100)
PY = ("python", "-c", "...")


def endpoint(pid: int = 500, port: int = 8100) -> Endpoint:
    return Endpoint(url=f"http://127.0.0.1:{port}", host="127.0.0.1", port=port, pid=pid, served_model_name="policy-v1",
                    version="1", model_dir="/s/models/1", log_path="/s/logs/v1.log",
                    started_at="2024-01-01T00:00:00+00:00")


LEADER_PROC = Proc(500, 1, 500, (sys.executable, "-m", SERVER_MODULE, "--model", "/s/models/1", "--port", "8100"),
                   frozenset({8100}), "/s/logs")
ENGINE = Proc(501, 1, 500, ("VLLM::EngineCore",), frozenset({40001}), "/s/logs")
WORKER = Proc(502, 501, 500, PY, frozenset(), "/s/logs")


def pids(procs) -> list[int]:
    return sorted(p.pid for p in procs)


def test_a_serving_leader_has_no_orphans_but_its_group_is_its_server():
    table = [LEADER_PROC, ENGINE, WORKER, Proc(600, 1, 600, PY)]
    assert orphaned(table, endpoint(), ME) == []
    assert pids(server_processes(table, endpoint(), ME)) == [500, 501, 502]


def test_with_the_leader_gone_its_group_and_its_look_alikes_on_its_port_are_orphans():
    left_group = Proc(503, 1, 503, ("VLLM::APIServer",), frozenset({8100}), "/s/logs")
    by_model = Proc(504, 1, 504, (sys.executable, "serve", "/s/models/1"), frozenset({8100}), "/")
    table = [ENGINE, WORKER, left_group, by_model]
    assert pids(orphaned(table, endpoint(), ME)) == [501, 502, 503, 504]


@pytest.mark.parametrize("stranger", [
    Proc(600, 1, 600, PY, frozenset({8100}), "/s/logs"),  # on the port, but not a vLLM server
    Proc(601, 1, 601, (sys.executable, "-m", SERVER_MODULE, "--port", "8100"), frozenset({8100}), "/other/logs"),
    Proc(602, 1, 602, ("VLLM::EngineCore",), frozenset({8200}), "/s/logs"),  # ours by look, not on the port
    Proc(ME[0], 1, 500, PY, frozenset({8100}), "/s/logs"),  # this very process
    Proc(603, ME[0], ME[1], ("VLLM::EngineCore",), frozenset({8100}), "/s/logs"),  # this process's group
], ids=["not-vllm", "another-checkouts-vllm", "another-port", "me", "my-group"])
def test_what_is_not_ours_is_never_an_orphan(stranger):
    assert pids(orphaned([ENGINE, stranger], endpoint(), ME)) == [501]


def test_a_leader_pid_reused_by_another_process_makes_the_group_someone_elses():
    reused = Proc(500, 1, 500, ("bash",), frozenset(), "/home")
    child = Proc(505, 500, 500, ("sleep", "60"), frozenset(), "/home")
    assert orphaned([reused, child], endpoint(), ME) == []


def test_an_announced_endpoint_has_no_processes_of_ours():
    assert server_processes([LEADER_PROC, ENGINE], endpoint(pid=0), ME) == []
