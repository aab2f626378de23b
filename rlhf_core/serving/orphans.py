"""What a vLLM server leaves behind when only its API server process dies, and ending it.

The API server leads its own process group (`start_new_session=True`: its pgid is its pid) and
vLLM's EngineCore process (and Worker processes, if any) inherit that group. SIGKILL the API
server alone and they live on, re-parented to PID 1, with gigabytes of memory and loopback
ports, and still in the recorded group. So a recorded server (`Endpoint.pid` and `.port`) is
ended by group and by port, whether its leader lives or not:

- by group: every process whose pgid is the recorded pid. A pid is never handed out again
  while a process group of that id has a member, so the members are the server's own unless
  the leader's pid now belongs to a live process that is not the server (the group is then
  someone else's, and left alone);
- by port: a process listening on the recorded port that looks like the server, e.g. one that
  left the group: its command line names the recorded model directory, or names vLLM while it
  runs in the recorded log directory (where `launch` starts the server; vLLM's engine
  processes name neither the model nor the port). Another checkout's vLLM on that port later
  is neither.

Never this process or its group. The decisions (`server_processes`, `orphaned`) are pure
functions over a process table; `read_process_table` reads it from psutil.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

from rlhf_core import vllm_scratch
from rlhf_core.serving.errors import ServingError
from rlhf_core.serving.process import KILL_GRACE_S, is_server_command
from rlhf_core.serving.state import Endpoint, recorded_endpoint

log = logging.getLogger(__name__)

POLL_S = 0.2


@dataclass(frozen=True)
class Proc:
    """One live (non-zombie) process, as far as ending a server cares."""

    pid: int
    ppid: int
    pgid: int
    cmdline: tuple[str, ...]
    listening: frozenset[int] = frozenset()  # TCP ports it listens on (only those asked about)
    cwd: str | None = None  # None where it cannot be read


Table = list[Proc]


def _looks_like_server(proc: Proc, endpoint: Endpoint) -> bool:
    if endpoint.model_dir and endpoint.model_dir in proc.cmdline:
        return True
    log_dir = os.path.realpath(Path(endpoint.log_path).parent) if endpoint.log_path else None
    return proc.cwd == log_dir and any("vllm" in arg.lower() for arg in proc.cmdline)


def server_processes(table: Iterable[Proc], endpoint: Endpoint, me: tuple[int, int]) -> Table:
    """The processes of the server `endpoint` records, its leader alive or not: the members of
    its process group (unless a live process that is not the server now holds the leader's pid)
    and the look-alikes listening on its port. `me` is (pid, pgid) of this process: never
    included, nor its group. Nothing for an endpoint without a pid (one announced, not started)."""
    table = list(table)
    pgid = endpoint.pid
    if pgid <= 1:
        return []
    leader = next((p for p in table if p.pid == pgid), None)
    group_is_ours = leader is None or is_server_command(leader.cmdline, endpoint.port)

    def ours(p: Proc) -> bool:
        if p.pid == me[0] or p.pgid == me[1] or p.pid <= 1:
            return False
        in_group = group_is_ours and p.pgid == pgid
        return in_group or (endpoint.port in p.listening and _looks_like_server(p, endpoint))

    return [p for p in table if ours(p)]


def orphaned(table: Iterable[Proc], endpoint: Endpoint, me: tuple[int, int]) -> Table:
    """The server's processes that still run although its leader (the API server) is gone:
    nothing while the leader serves."""
    table = list(table)
    leader = next((p for p in table if p.pid == endpoint.pid), None)
    if leader is not None and is_server_command(leader.cmdline, endpoint.port):
        return []
    return server_processes(table, endpoint, me)


def read_process_table(ports: Collection[int] = ()) -> Table:
    """Every live process this user may see, with the ones of `ports` it listens on."""
    listening: dict[int, set[int]] = {}
    if ports:
        with contextlib.suppress(psutil.Error, OSError):
            for conn in psutil.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN and conn.pid and conn.laddr and conn.laddr.port in ports:
                    listening.setdefault(conn.pid, set()).add(conn.laddr.port)
    table = []
    for proc in psutil.process_iter(["ppid", "cmdline", "status", "cwd"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            pgid = os.getpgid(proc.pid)
        except (ProcessLookupError, PermissionError):
            continue
        table.append(Proc(proc.pid, proc.info["ppid"] or 0, pgid, tuple(proc.info["cmdline"] or ()),
                          frozenset(listening.get(proc.pid, ())), proc.info["cwd"]))
    return table


def me() -> tuple[int, int]:
    return os.getpid(), os.getpgrp()


@dataclass(frozen=True)
class Orphans:
    """Processes of the recorded server that outlived it."""

    endpoint: Endpoint
    pids: tuple[int, ...]

    def __str__(self) -> str:
        n = len(self.pids)
        return (f"{n} orphaned process{'es' if n != 1 else ''} of the last server (pids "
                f"{', '.join(map(str, self.pids))}, pgid {self.endpoint.pid}) still run: `rlhf serving stop` ends them")


def find_orphans(state_dir: Path) -> Orphans | None:
    """The orphans of the server `<state_dir>/current.json` records, if any."""
    endpoint = recorded_endpoint(state_dir)
    if endpoint is None or endpoint.pid <= 1:
        return None
    left = orphaned(read_process_table({endpoint.port}), endpoint, me())
    return Orphans(endpoint, tuple(sorted(p.pid for p in left))) if left else None


def end_server(endpoint: Endpoint, grace_s: float = KILL_GRACE_S) -> list[int]:
    """SIGTERM every process of the server `endpoint` records (its group via `os.killpg`, even
    with the leader gone, and its look-alikes on its port), SIGKILL what is left after `grace_s`,
    and return once none lives. The pids it signalled, sorted; [] if there was none."""
    ports = {endpoint.port}
    found = server_processes(read_process_table(ports), endpoint, me())
    if not found:
        vllm_scratch.sweep()
        return []
    signalled = {p.pid for p in found}
    _signal(found, endpoint.pid, signal.SIGTERM)
    left = _wait_gone(endpoint, ports, grace_s)
    if left:
        log.warning("%d process(es) of %s (pgid %d) still run %.0f s after SIGTERM; sending SIGKILL",
                    len(left), endpoint.served_model_name, endpoint.pid, grace_s)
        signalled |= {p.pid for p in left}
        _signal(left, endpoint.pid, signal.SIGKILL)
        left = _wait_gone(endpoint, ports, KILL_GRACE_S)  # under load, the kernel can take many seconds
    if left:
        raise ServingError(f"processes {sorted(p.pid for p in left)} of process group {endpoint.pid} survived SIGKILL")
    vllm_scratch.sweep()  # the server's directory of vLLM's files (rlhf_core.vllm_scratch), now that it is gone
    return sorted(signalled)


def _signal(procs: Table, pgid: int, sig: int) -> None:
    if any(p.pgid == pgid for p in procs) and pgid != os.getpgrp():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p.pid, sig)


def _wait_gone(endpoint: Endpoint, ports: Collection[int], timeout_s: float) -> Table:
    """Wait up to `timeout_s` for the server's processes to be gone; those still there."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(endpoint.pid, os.WNOHANG)  # reap the leader if it is our child
        left = server_processes(read_process_table(ports), endpoint, me())
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(POLL_S)
