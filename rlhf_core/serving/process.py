"""vLLM's OpenAI-compatible server as a detached process: its command line and environment,
starting it, knowing it again by pid and port, stopping its whole process group, and reading
its log for the cause of a failure.

The server is detached: started with `start_new_session=True`, it outlives the process that
deployed it (a Prefect flow run) and is stopped as a process group (SIGTERM, then SIGKILL),
which also reaches vLLM's engine-core process and any worker process (what they become when
the API server is killed alone, and how they are found and ended: `rlhf_core.serving.orphans`).

Telemetry is off (`VLLM_NO_USAGE_STATS`, `VLLM_DO_NOT_TRACK`, `DO_NOT_TRACK`). The KV cache
is sized with `--kv-cache-memory-bytes` from `cfg.kv_cache_gib` (fractions of a GiB allowed)
and `VLLM_CPU_KVCACHE_SPACE` is removed from the server's environment: that legacy variable
takes whole GiB only and, if set, silently overrides the flag on the CPU backend.

On the CPU backend vLLM binds its OpenMP threads to cores (`VLLM_CPU_OMP_THREADS_BIND=auto`),
the same cores for every server: a new server starting beside one under traffic starved and
never became healthy (docs/performance-notes.md, Serving). The servers started here use `cfg.cpu_threads_bind`,
"nobind" by default.

With "nobind" the model also runs in the engine-core process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
unless set outside): vLLM's CPU backend otherwise gives its one worker a process of its own
only to set up its OpenMP threads there, which "nobind" skips, and every process it spawns
imports vLLM again. The engine core stays a process of its own either way (what that saves:
docs/performance-notes.md, "Serving"). A core list or "auto" keeps vLLM's worker process, where those threads are set up. Off CPU
this changes nothing: one GPU already runs in the engine core.

vLLM leaves its sockets and (once stopped) its CPU backend's rendezvous file in the temp
directory: the server gets a directory of its own for them instead (`VLLM_RPC_BASE_PATH` and
`TMPDIR`, unless VLLM_RPC_BASE_PATH is set outside), removed once the server is stopped
(`rlhf_core.vllm_scratch`).

Two middlewares of this package are loaded into the server: `RequireApiKey` (the key on every
path but `/health` and `/metrics`) and, inside it, `DrainGate` (`rlhf_core.serving.drain`: how a
replaced server stops taking requests and answers those it accepted before it is stopped).

Unless `cfg.chunked_prefill`, the server never splits a prompt across scheduler steps
(`--no-enable-chunked-prefill`; a step takes whole prompts up to `SERVER_PREFILL_TOKENS`
tokens, or one of `max_model_len`). vLLM's CPU backend cannot sample a seeded request whose
prefill was split ("CPU Generator does not use offset", vLLM 0.32): four completion requests
at once, each for 64 seeded samples (`n`, `seed`) of a 43-token prompt, against the CPU
server's 2,048 tokens a step, killed the engine, and every later request got 500. On GPU,
turn it on.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from rlhf_core import vllm_scratch
from rlhf_core.config import ServingConfig
from rlhf_core.serving.auth import RequireApiKey
from rlhf_core.serving.drain import DrainGate
from rlhf_core.serving.errors import ServingError

log = logging.getLogger(__name__)

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
GiB = 1 << 30
SERVER_PREFILL_TOKENS = 2048  # vLLM's default token budget of a step for its server on CPU
LOG_TAIL_LINES = 20
KILL_GRACE_S = 30.0
# A server that never passed its health check (its deploy failed, or died) has no requests to
# finish: SIGTERM gets this long before SIGKILL. A vLLM server still loading its model can
# ignore SIGTERM until it has (measured: the whole 30 s drain time, on a killed deploy).
UNSERVED_GRACE_S = 5.0


def server_command(model_dir: Path, name: str, port: int, max_model_len: int, cfg: ServingConfig) -> list[str]:
    """The command line of vLLM's OpenAI-compatible server for `model_dir` (no key: that goes
    through the environment)."""
    return [
        sys.executable, "-m", SERVER_MODULE,
        "--model", str(model_dir),
        "--served-model-name", name,
        "--host", cfg.host,
        "--port", str(port),
        "--dtype", cfg.dtype,
        "--max-model-len", str(max_model_len),
        "--enforce-eager",
        "--kv-cache-memory-bytes", str(int(cfg.kv_cache_gib * GiB)),
        # The last one given is the outermost: RequireApiKey guards DrainGate's POST /drain.
        "--middleware", f"{DrainGate.__module__}.{DrainGate.__qualname__}",
        "--middleware", f"{RequireApiKey.__module__}.{RequireApiKey.__qualname__}",
        *([] if cfg.chunked_prefill else [
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_model_len, SERVER_PREFILL_TOKENS))]),
        *cfg.extra_args,
    ]


def launch(
    model_dir: Path, name: str, port: int, max_model_len: int, cfg: ServingConfig, api_key: str, log_path: Path
) -> subprocess.Popen:
    cmd = server_command(model_dir, name, port, max_model_len, cfg)
    env = dict(os.environ)
    env.pop(cfg.api_key_env, None)  # the server needs only VLLM_API_KEY
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override --kv-cache-memory-bytes
    env.update(VLLM_API_KEY=api_key, VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1", DO_NOT_TRACK="1",
               VLLM_CPU_OMP_THREADS_BIND=cfg.cpu_threads_bind)
    if cfg.cpu_threads_bind == "nobind":  # the model in the engine-core process (module docstring)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # The server imports RequireApiKey from this very checkout, installed or not.
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    vllm_scratch.sweep()
    scratch = None if "VLLM_RPC_BASE_PATH" in env else vllm_scratch.new_dir()
    if scratch is not None:  # the files vLLM leaves in the temp directory go with the server (module docstring)
        env.update(VLLM_RPC_BASE_PATH=str(scratch), TMPDIR=str(scratch))
    try:
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                cwd=log_path.parent, start_new_session=True,
            )
        if scratch is not None:
            vllm_scratch.claim(scratch, proc.pid)
    except BaseException:
        vllm_scratch.remove(scratch)
        raise
    return proc


def stop_process_group(pid: int, timeout: float = KILL_GRACE_S) -> None:
    """SIGTERM the process group led by `pid`, SIGKILL whatever is left after `timeout` s.
    Returns once no live (non-zombie) member remains."""
    if not _signal_group(pid, signal.SIGTERM):
        vllm_scratch.sweep()
        return
    if not _wait_group_gone(pid, timeout):
        log.warning("process group %d still running %.0f s after SIGTERM; sending SIGKILL", pid, timeout)
        _signal_group(pid, signal.SIGKILL)
        if not _wait_group_gone(pid, KILL_GRACE_S):  # under load, the kernel can take many seconds to reap it
            raise ServingError(f"process group {pid} survived SIGKILL")
    vllm_scratch.sweep()  # the group's scratch directory, now that its owner is gone


def port_in_use(host: str, port: int) -> bool:
    """True if we cannot bind host:port the way uvicorn will (SO_REUSEADDR: connections in
    TIME_WAIT from a stopped server do not count, a listener does)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise ServingError(f"cannot bind {host}:{port}: {e}") from e
    return False


# A log line whose message is an exception, e.g. "(EngineCore pid=7) ERROR 11-22 10:37:16
# [x.py:9] safetensors._safetensors_rust.SafetensorError: Error while deserializing header".
_EXCEPTION_LINE = re.compile(
    r"^(?:\([^)]*\) )?(?:[A-Z]+ \S+ \S+ \[[^\]]*\] )?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)(?::\s.*)?)$"
)


def _log_lines(log_path: Path) -> list[str]:
    try:
        return log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def first_error(log_path: Path) -> str | None:
    """The first exception line in the server log: usually the root cause."""
    return next((m.group(1) for line in _log_lines(log_path) if (m := _EXCEPTION_LINE.match(line))), None)


def log_summary(log_path: Path) -> str:
    first = first_error(log_path)
    head = f"first error in the server log: {first}\n" if first else ""
    tail = "\n".join(_log_lines(log_path)[-LOG_TAIL_LINES:])
    return f"{head}--- last {LOG_TAIL_LINES} lines of {log_path} ---\n{tail}"


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of a live pid from /proc, None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]  # comm may hold spaces and ")"
    return state, int(pgrp)


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _proc_stat(int(entry))) is not None and st[1] == pgid and st[0] != "Z":
            members.append(int(entry))
    return members


def servers_started_in(directory: Path, port: int) -> list[int]:
    """Pids of live vLLM API servers on `port` whose working directory is `directory` (where
    `launch` starts them): a server whose deploy died before recording it."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and is_server(int(entry), port):
            with contextlib.suppress(OSError):
                if Path(os.readlink(f"/proc/{entry}/cwd")) == Path(directory).resolve():
                    found.append(int(entry))
    return found


def is_server(pid: int, port: int) -> bool:
    """Is `pid` a live vLLM API server on `port`? Guards against a pid reused after a reboot."""
    st = _proc_stat(pid)
    if st is None or st[0] == "Z":
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return is_server_command([a.decode(errors="replace") for a in argv], port)


def is_server_command(args: list[str] | tuple[str, ...], port: int) -> bool:
    """Is `args` the command line of a vLLM API server on `port`?"""
    return SERVER_MODULE in args and any(a == "--port" and b == str(port) for a, b in zip(args, args[1:]))


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pgid, os.WNOHANG)  # reap the leader if it is our child
        if not _group_members(pgid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
