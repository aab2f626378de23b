"""The feedback gateway: an OpenAI-compatible front of the served model that remembers what it
served and takes ratings on it.

    client ──► gateway (127.0.0.1:8200) ──► the vLLM server in <state_dir>/current.json
                 │ records every answer (feedback store)
                 └ POST /v1/feedback: thumbs up/down, a score, a comment, or a choice

- `POST /v1/completions` and `POST /v1/chat/completions`, streaming included, pass through to
  whichever server `current.json` names now: a blue/green deploy moves the gateway's traffic
  with it, and clients keep one address. While a canary runs (`canary.json`), the share of
  users it draws is sent to it instead, each user always to the same version. The gateway asks for the served name itself, so a
  client may name any model (`"policy"`). The answer's `id` is replaced by the gateway's
  response id (also in the `x-response-id` header), under which its answers were recorded
  before the client got the last byte: a client that has the answer can always rate it.
  `n` > 1 (up to `max_samples`) serves answers to choose between.
- `POST /v1/feedback` with `{"response_id", "rating": "up"|"down", "score", "comment",
  "choice_index"}` rates one answer; `{"response_id", "preferred": i}` chooses between the
  answers of a response. The rater is the user the application signed (`user_auth`), hashed
  with the gateway's secret salt before it is stored; unsigned feedback is refused or, as
  configured, recorded as one anonymous user. Answers: 200 `{"status": "created" | "updated" |
  "duplicate"}` (a repeat is counted once), 400 naming the field at fault, 401 without the key
  or a signed user, 404 for an unknown response id, 413 for a body over its limit, 429 when one
  user (or all anonymous feedback together) sends more than `ratings_per_minute`.
- `DELETE /v1/users/{user}` deletes a user's responses, answers, ratings and choices: with that
  user's signature or the admin key, else 403.
- `GET /health` (no key): 200 only while the upstream answers its own health check, else 503;
  `GET /livez` (no key): the gateway's process answers; `GET /metrics` (no key, Prometheus).

The same API key as serving (`rlhf_core.serving.auth`) guards everything but the probes and
metrics. A rating is acknowledged only once its transaction has committed. Answers to clients
name no internals (upstream URLs, errors): those go to the log.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections import defaultdict
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rlhf_core.config import CanaryConfig
from rlhf_core.feedback.store import Answer, FeedbackError, FeedbackStore, hash_user
from rlhf_core.serving.auth import RequireApiKey
from rlhf_core.serving.gateway_feedback import BadRequest, FeedbackRequest, parse_feedback  # noqa: F401 - public here too
from rlhf_core.serving.gateway_limits import BodyTooLarge, RateLimiter, read_body
from rlhf_core.serving.gateway_metrics import CanaryCollector, Metrics, ThumbsCollector, served_versions  # noqa: F401 - public here too
from rlhf_core.serving.gateway_upstream import Upstream
from rlhf_core.serving.gateway_writer import BatchWriter
from rlhf_core.serving.user_auth import SIGNATURE_HEADER, USER_SECRET_FILE, Unauthenticated, UserAuth

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/livez", "/metrics")


def error(status: int, message: str, field_name: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"message": message, "code": status}
    if field_name:
        body["field"] = field_name
    return JSONResponse({"error": body}, status_code=status)


def unavailable(reason: str) -> JSONResponse:
    return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)


class Gateway:
    def __init__(self, store: FeedbackStore, state_dir: Path, api_key: str, salt: str, *, users: UserAuth,
                 ratings_per_minute: int = 60, max_samples: int = 4, upstream_timeout_s: float = 120.0,
                 max_feedback_bytes: int = 64 * 1024, max_completion_bytes: int = 1024 * 1024,
                 canary: CanaryConfig = CanaryConfig()):
        self.store, self.api_key, self.salt, self.users = store, api_key, salt, users
        self.state_dir, self.upstream = Path(state_dir), Upstream(state_dir)
        self.limiter = RateLimiter(ratings_per_minute)
        self.max_samples = max_samples
        self.max_bytes = {"feedback": max_feedback_bytes, "completion": max_completion_bytes}
        self.timeout_s = upstream_timeout_s
        self.session: aiohttp.ClientSession | None = None
        self.metrics = Metrics()
        self.metrics.registry.register(ThumbsCollector(store, Path(state_dir)))
        self.metrics.registry.register(CanaryCollector(store, self.upstream, canary))
        self._limited_logged: dict[str, float] = {}
        self.writer = BatchWriter(store)

    def _record(self, answers: list[Answer], record: dict) -> None:
        """Queue the record of a served response. The client does not wait for its commit: the
        writer applies writes in order, so any rating of it, sent after the client got its id,
        is applied after it. A crash can lose the records of the last few milliseconds of
        answers (ratings of them then get 404), never an acknowledged rating."""
        future = self.writer.submit(lambda conn: self.store.record_response(answers_=answers, **record, conn=conn))
        future.add_done_callback(_log_failed_record)

    async def _write(self, call):
        """`call(conn)` applied by the store's writer; returns once its transaction committed."""
        return await asyncio.wrap_future(self.writer.submit(call))

    async def _json_body(self, request: Request, kind: str) -> Any:
        """The JSON body of a `kind` ("feedback" or "completion") request, read no further than
        its limit; `BadRequest` (413 or 400) else."""
        try:
            raw = await read_body(request, self.max_bytes[kind])
        except BodyTooLarge as e:
            raise BadRequest("body", str(e), status=413) from e
        try:
            return json.loads(raw)
        except ValueError:
            raise BadRequest("body", "not valid JSON") from None

    # --- serving --------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "/v1/completions", "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "/v1/chat/completions", "chat")

    async def _serve(self, request: Request, path: str, kind: str) -> Response:
        started = time.perf_counter()
        try:
            asker = self.users.asker(request.headers)
            payload = await self._json_body(request, "completion")
        except Unauthenticated as e:
            return self._count(path, error(401, str(e), SIGNATURE_HEADER))
        except BadRequest as e:
            return self._count(path, error(e.status, str(e), e.field))
        if not isinstance(payload, dict):
            return self._count(path, error(400, "the body must be a JSON object", "body"))
        n = payload.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.max_samples:
            return self._count(path, error(400, f"must be an integer from 1 to {self.max_samples}, got {n!r}", "n"))
        user_hash = hash_user(asker, self.salt)
        endpoint = self.upstream.get(user_hash)
        if endpoint is None:
            return self._count(path, error(503, "no model is being served (no current deployment)"))
        prompt = payload.get("messages") if kind == "chat" else payload.get("prompt")
        payload["model"] = endpoint.served_model_name
        t0 = time.perf_counter()
        try:
            upstream = await self.session.post(
                endpoint.url + path, data=json.dumps(payload).encode(),
                headers={"authorization": f"Bearer {self.api_key}", "content-type": "application/json"})
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("the served model at %s did not answer %s: %r", endpoint.url, path, e)
            return self._count(path, error(502, "the served model did not answer"))
        response_id = f"resp-{uuid.uuid4().hex}"
        record = dict(response_id=response_id, model_version=endpoint.version, served_model=endpoint.served_model_name,
                      kind=kind, prompt=prompt, user_hash=user_hash)
        if upstream.status != 200:
            return self._count(path, await _upstream_refusal(upstream, endpoint.url + path))
        if payload.get("stream"):
            return self._count(path, self._stream(upstream, response_id, record))
        async with upstream:
            content = await upstream.read()
        upstream_s = time.perf_counter() - t0
        data = json.loads(content)
        data["id"] = response_id
        answers = [Answer(_text(c, kind), c.get("finish_reason")) for c in sorted(data.get("choices", []),
                                                                                   key=lambda c: c.get("index", 0))]
        self._record(answers, record)
        self.metrics.added.labels(path).observe(max(time.perf_counter() - started - upstream_s, 0.0))
        return self._count(path, JSONResponse(data, headers={"x-response-id": response_id}))

    def _stream(self, upstream: aiohttp.ClientResponse, response_id: str, record: dict) -> Response:
        kind = record["kind"]

        async def events():
            texts: dict[int, list[str]] = defaultdict(list)
            finish: dict[int, str | None] = {}
            try:
                async for raw in upstream.content:
                    line = raw.decode()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        answers = [Answer("".join(texts[i]), finish.get(i)) for i in sorted(texts)]
                        self._record(answers, record)
                        yield b"data: [DONE]\n\n"
                        continue
                    chunk = json.loads(data)
                    chunk["id"] = response_id
                    for c in chunk.get("choices", []):
                        i = c.get("index", 0)
                        texts[i].append(_delta(c, kind))
                        if c.get("finish_reason"):
                            finish[i] = c["finish_reason"]
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
            finally:
                upstream.release()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"x-response-id": response_id})

    async def models(self, request: Request) -> Response:
        endpoint = self.upstream.get()
        if endpoint is None:
            return error(503, "no model is being served (no current deployment)")
        created = int(time.time())
        return JSONResponse({"object": "list", "data": [
            {"id": endpoint.served_model_name, "object": "model", "created": created, "owned_by": "rlhf-pipeline",
             "version": endpoint.version}]})

    # --- feedback -------------------------------------------------------------------------

    async def feedback(self, request: Request) -> Response:
        route = "/v1/feedback"
        try:
            rater = self.users.rater(request.headers)
        except Unauthenticated as e:
            self.metrics.rejected.labels("unauthenticated").inc()
            return self._count(route, error(401, str(e), SIGNATURE_HEADER))
        try:
            fb = parse_feedback(await self._json_body(request, "feedback"), rater)
        except BadRequest as e:
            self.metrics.rejected.labels("too_large" if e.status == 413 else "malformed").inc()
            return self._count(route, error(e.status, str(e), e.field))
        user_hash = hash_user(fb.user, self.salt)
        if not self.limiter.allow(user_hash):
            self.metrics.rejected.labels("rate_limited").inc()
            self._log_limited(user_hash)
            return self._count(route, error(429, "too much feedback from this user; retry in a minute"))
        try:
            recorded, kind = await self._apply(fb, user_hash)
        except FeedbackError as e:
            self.metrics.rejected.labels("unknown_response" if e.status == 404 else "malformed").inc()
            field_name = "response_id" if e.status == 404 else str(e).split(":")[0]
            return self._count(route, error(e.status, str(e), field_name))
        if recorded.status == "duplicate":
            self.metrics.duplicates.inc()
        else:
            self.metrics.feedback.labels(recorded.model_version, kind).inc()
        return self._count(route, JSONResponse({"status": recorded.status, "response_id": fb.response_id}))

    async def _apply(self, fb: FeedbackRequest, user_hash: str):
        """Record a rating or a choice; returns (the store's answer, the kind of feedback)."""
        if fb.preferred is not None:
            recorded = await self._write(
                lambda conn: self.store.choose(fb.response_id, user_hash, fb.preferred, fb.comment, conn=conn))
            return recorded, "choice"
        recorded = await self._write(
            lambda conn: self.store.rate(fb.response_id, user_hash, choice_index=fb.choice_index,
                                         thumb=fb.thumb, score=fb.score, comment=fb.comment, conn=conn))
        return recorded, {1: "up", -1: "down", None: "score"}[fb.thumb]

    def _log_limited(self, user_hash: str) -> None:
        now = time.monotonic()
        if now - self._limited_logged.get(user_hash, -1e9) >= 60:
            self._limited_logged[user_hash] = now
            log.warning("user %s sends more than %d ratings a minute; the excess is refused", user_hash,
                        self.limiter.per_minute)

    async def delete_user(self, request: Request) -> Response:
        user = request.path_params["user"]
        if not self.users.may_delete(request.headers, user):
            return error(403, "deleting a user's data needs that user's signature or the admin key")
        user_hash = hash_user(user, self.salt)
        deleted = await self._write(lambda conn: self.store.delete_user(user_hash, conn=conn))
        log.info("deleted the data of user %s: %s", user_hash, deleted)
        return JSONResponse({"deleted": deleted})

    # --- probes ---------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        endpoint = self.upstream.get()
        if endpoint is None:
            return unavailable("no model is being served")
        if not await self.upstream.healthy(self.session, endpoint):
            return unavailable("the served model does not answer its health check")
        return JSONResponse({"status": "ok", "version": endpoint.version})

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def prometheus(self, request: Request) -> Response:
        self.metrics.serving.clear()
        if (endpoint := self.upstream.get()) is not None:
            self.metrics.serving.labels(endpoint.version).set(1)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def _count(self, route: str, response: Response) -> Response:
        self.metrics.requests.labels(route, str(response.status_code)).inc()
        return response

    # --- the ASGI app ---------------------------------------------------------------------

    def app(self):
        @contextlib.asynccontextmanager
        async def lifespan(_app):
            self.session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, connect=5.0),
                connector=aiohttp.TCPConnector(limit=256), auto_decompress=False)
            try:
                yield
            finally:
                await self.session.close()
                self.writer.close()

        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/livez", self.live, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/feedback", self.feedback, methods=["POST"]),
            Route("/v1/users/{user}", self.delete_user, methods=["DELETE"]),
        ]
        return RequireApiKey(Starlette(routes=routes, lifespan=lifespan), key=self.api_key, open_paths=OPEN_PATHS)


async def _upstream_refusal(upstream: aiohttp.ClientResponse, url: str) -> Response:
    """The client's answer when the served model answered other than 200: its own 4xx (about the
    request), a bare 502 for its failures (their text goes to the log)."""
    async with upstream:
        content = await upstream.read()
    if upstream.status < 500:
        return Response(content, upstream.status, media_type=upstream.content_type)
    log.warning("the served model at %s answered %d: %s", url, upstream.status, content[:2000])
    return error(502, "the served model failed to answer")


def _log_failed_record(future: Future) -> None:
    if (e := future.exception()) is not None:
        log.error("recording a served response failed: %r", e)


def _text(choice: dict, kind: str) -> str:
    if kind == "chat":
        return (choice.get("message") or {}).get("content") or ""
    return choice.get("text") or ""


def _delta(choice: dict, kind: str) -> str:
    if kind == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def store_url(cfg) -> str:
    """$<feedback.store_url_env> if set, else `feedback.store_url`, else SQLite `feedback.db` in
    the serving state directory."""
    from rlhf_core.feedback.store import sqlite_url  # noqa: PLC0415
    from rlhf_core.serving.state import state_dir_for  # noqa: PLC0415

    f = cfg.feedback
    return os.environ.get(f.store_url_env) or f.store_url or sqlite_url(
        state_dir_for(cfg.serving, cfg.output_dir) / "feedback.db")


def build_gateway(cfg) -> Gateway:
    """The gateway of a pipeline config: its store, the serving API key and state, the salt for
    user ids (`feedback.salt_file`, else `<state_dir>/user_salt`, mode 0600), and the
    user-signing secret and admin key (`user_auth.user_auth_for`)."""
    from rlhf_core.serving.auth import resolve_api_key, secret_file  # noqa: PLC0415
    from rlhf_core.serving.state import state_dir_for  # noqa: PLC0415
    from rlhf_core.serving.user_auth import user_auth_for  # noqa: PLC0415

    state_dir = state_dir_for(cfg.serving, cfg.output_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    f = cfg.feedback
    salt = secret_file(Path(f.salt_file) if f.salt_file else state_dir / "user_salt")
    return Gateway(FeedbackStore(store_url(cfg)), state_dir, resolve_api_key(cfg.serving, state_dir), salt,
                   users=user_auth_for(f, state_dir), ratings_per_minute=f.ratings_per_minute,
                   max_samples=f.max_samples, upstream_timeout_s=f.upstream_timeout_s,
                   max_feedback_bytes=f.max_feedback_bytes, max_completion_bytes=f.max_completion_bytes,
                   canary=cfg.serving.canary)


def run_gateway(cfg) -> None:
    """Serve the gateway in this process until it is stopped (SIGINT/SIGTERM)."""
    import uvicorn  # noqa: PLC0415

    gateway = build_gateway(cfg)
    if cfg.feedback.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("the feedback gateway binds to %s: it is reachable beyond this machine", cfg.feedback.host)
    log.info("feedback needs user ids signed with the user-signing secret ($%s, else %s)",
             cfg.feedback.user_secret_env, gateway.state_dir / USER_SECRET_FILE)
    try:
        uvicorn.run(gateway.app(), host=cfg.feedback.host, port=cfg.feedback.port, log_level="warning",
                    access_log=False, timeout_graceful_shutdown=10)
    finally:
        gateway.store.close()
