"""Draining the previous server after a blue/green switch: it stops taking requests first, answers
every request it accepted, and only then is stopped.

vLLM's own SIGTERM does this in the wrong order for a switch (vLLM 0.32,
`vllm.entrypoints.launchers.launcher.serve_http`): it shuts the engine down first (aborting
what runs with the default `--shutdown-timeout 0`; with a positive one the engine drains, but
it rejects every request added meanwhile) while uvicorn still accepts connections, and tells
uvicorn to stop only once the engine is gone. A request accepted in that window is answered
with an error, and a signal to the process group reaches the engine core directly too.

So `DrainGate`, loaded into the server with `--middleware` beside `RequireApiKey` (which guards
it), does uvicorn's graceful first half on `POST /drain`:

1. every later request on an open connection gets 503 with `connection: close`, and the
   server's listening socket is closed (uvicorn's `Server.servers`, which vLLM keeps in
   `app.state.server`): a new connection is refused. Both are refusals before accept;
2. it waits until the requests in flight at that moment are answered (counted at the HTTP
   layer: from the request's arrival to its response's last byte, so one still being tokenised
   or streamed counts) and their connections are closed, or `timeout` seconds pass;
3. it answers with the counts. Only then does the deploy SIGTERM the process group, which
   then holds no request to abort.

A server that predates the gate (404) is drained the old way: its `/metrics` are polled until
vLLM counts no running or waiting request. One API server process per server is assumed (vLLM's
default): with `--api-server-count` above 1, `POST /drain` reaches only one of them.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from urllib.parse import parse_qs

import httpx

from rlhf_core.serving.auth import OPEN_PATHS
from rlhf_core.serving.client import requests_in_flight

log = logging.getLogger(__name__)

DRAIN_PATH = "/drain"
DRAIN_GRACE_S = 1.0  # a request the gateway routed a moment before the switch is on its way
GATE_POLL_S, METRICS_POLL_S = 0.05, 0.25


def may_stop(in_flight: float, open_connections: int, elapsed_s: float, timeout_s: float) -> bool:
    """May a draining server be stopped? Once nothing it accepted is in flight and no connection
    to it is open (a client sending on one would be cut off), or once `timeout_s` has passed."""
    return (in_flight <= 0 and open_connections <= 0) or elapsed_s >= timeout_s


@dataclass(frozen=True)
class Drained:
    """How the previous server's drain went."""

    gated: bool  # it closed to new requests (DrainGate); False: it predates the gate
    in_flight_at_close: int | None  # requests it had accepted and not answered when it closed
    in_flight_left: int  # still unanswered when the drain ended (timed out): these are aborted
    seconds: float
    closed_at: float | None = None  # unix time the server closed to new requests


class DrainGate:
    """ASGI middleware loaded into the vLLM server: counts the HTTP requests in flight and, on
    `POST /drain?timeout=S`, closes the server to new requests and answers once those in flight
    are answered (see the module docstring). `/health` and `/metrics` pass through uncounted."""

    def __init__(self, app):
        self.app = app
        self.in_flight = 0
        self.draining = False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")).rstrip("/") or "/"
        if path == DRAIN_PATH:
            return await self._drain(scope, send)
        if path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self.draining:
            return await _respond(send, 503, {"error": {"message": "this server is shutting down; the deployment "
                                                        "that replaced it serves", "code": 503}})
        self.in_flight += 1
        try:
            await self.app(scope, receive, self._closing(send))
        finally:
            self.in_flight -= 1

    def _closing(self, send):
        """`send`, adding `connection: close` to a response that starts while draining."""
        async def send_(message):
            if self.draining and message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)
        return send_

    async def _drain(self, scope, send):
        if scope.get("method") != "POST":
            return await _respond(send, 405, {"error": {"message": f"POST {DRAIN_PATH}", "code": 405}})
        try:
            timeout_s = max(0.0, float(parse_qs(scope.get("query_string", b"").decode("latin-1"))["timeout"][0]))
        except (KeyError, ValueError):
            return await _respond(send, 400, {"error": {"message": "?timeout=<seconds> is needed", "code": 400}})
        server = getattr(getattr(scope.get("app"), "state", None), "server", None)  # vLLM's uvicorn server
        self.draining = True
        closed_at, at_close = time.time(), self.in_flight
        for listener in getattr(server, "servers", []):
            listener.close()  # new connections are refused from now on
        start = time.monotonic()
        while not may_stop(self.in_flight, _others(server), time.monotonic() - start, timeout_s):
            await asyncio.sleep(GATE_POLL_S)
        await _respond(send, 200, {"in_flight_at_close": at_close, "in_flight": self.in_flight,
                                   "open_connections": _others(server), "closed_at": closed_at,
                                   "seconds": round(time.monotonic() - start, 3)})


def _others(server) -> int:
    """Open connections to `server` besides the one asking it to drain (0 if unknown)."""
    connections = getattr(getattr(server, "server_state", None), "connections", None)
    return max(0, len(connections) - 1) if connections is not None else 0


async def _respond(send, status: int, body: dict) -> None:
    content = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
               (b"connection", b"close")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content})


def drain(url: str, api_key: str | None, timeout_s: float) -> Drained:
    """Close the server at `url` to new requests and wait, up to `timeout_s` in all, until it has
    answered those it accepted. Returns once it may be stopped."""
    start = time.monotonic()
    time.sleep(min(DRAIN_GRACE_S, timeout_s))
    left = max(0.0, timeout_s - (time.monotonic() - start))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(timeout=left + 30, trust_env=False) as client:
            r = client.post(f"{url}{DRAIN_PATH}", params={"timeout": left}, headers=headers)
    except httpx.HTTPError as e:  # gone already, or hung: nothing to wait for
        log.warning("could not drain %s (%r); stopping it", url, e)
        return Drained(False, None, 0, time.monotonic() - start)
    if r.status_code != 200:
        log.info("%s has no drain gate (POST %s: HTTP %d); waiting for vLLM to count no request",
                 url, DRAIN_PATH, r.status_code)
        return _drain_by_metrics(url, timeout_s, start)
    body = r.json()
    return Drained(True, int(body["in_flight_at_close"]), int(body["in_flight"]), time.monotonic() - start,
                   float(body["closed_at"]))


def _drain_by_metrics(url: str, timeout_s: float, start: float) -> Drained:
    """A server without the gate: wait until its /metrics count no running or waiting request."""
    while not may_stop(busy := requests_in_flight(url), 0, time.monotonic() - start, timeout_s):
        time.sleep(METRICS_POLL_S)
    return Drained(False, None, int(busy), time.monotonic() - start)
