"""The feedback gateway: an OpenAI-compatible front of the served model that remembers what it
served and takes ratings on it.

    client ──► gateway (127.0.0.1:8200) ──► the vLLM server in <state_dir>/current.json
                 │ records every answer (feedback store)
                 └ POST /v1/feedback: thumbs up/down, a score, a comment, or a choice

- `POST /v1/completions` and `POST /v1/chat/completions`, streaming included, pass through to
  whichever server `current.json` names now: a blue/green deploy moves the gateway's traffic
  with it, and clients keep one address. The gateway asks for the served name itself, so a
  client may name any model (`"policy"`). The answer's `id` is replaced by the gateway's
  response id (also in the `x-response-id` header), under which its answers were recorded
  before the client got the last byte: a client that has the answer can always rate it.
  `n` > 1 (up to `max_samples`) serves answers to choose between.
- `POST /v1/feedback` with `{"response_id", "rating": "up"|"down", "score", "comment",
  "choice_index"}` rates one answer; `{"response_id", "preferred": i}` chooses between the
  answers of a response. The user is the request's `user` field (as in OpenAI's API) or the
  `x-user-id` header, hashed with the gateway's secret salt before it is stored. Answers:
  200 `{"status": "created" | "updated" | "duplicate"}` (a repeat is counted once), 400
  naming the field at fault, 401 without the key, 404 for an unknown response id, 429 when
  one user sends more than `ratings_per_minute`.
- `DELETE /v1/users/{user}` deletes a user's responses, answers, ratings and choices.
- `GET /health` (no key) and `GET /metrics` (no key, Prometheus).

The same API key as serving (`rlhf_core.serving.auth`) guards everything but the health and
metrics paths. A rating is acknowledged only once its transaction has committed.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections import defaultdict, deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rlhf_core.feedback.store import Answer, FeedbackError, FeedbackStore, hash_user
from rlhf_core.serving.auth import RequireApiKey
from rlhf_core.serving.gateway_metrics import Metrics, ThumbsCollector, served_versions  # noqa: F401 - public here too
from rlhf_core.serving.state import Endpoint

log = logging.getLogger(__name__)

FEEDBACK_FIELDS = {"response_id", "rating", "score", "comment", "choice_index", "preferred", "user"}
MAX_COMMENT = 4000


class BadRequest(Exception):
    def __init__(self, field_name: str, message: str, status: int = 400):
        super().__init__(f"{field_name}: {message}")
        self.field, self.status = field_name, status


def error(status: int, message: str, field_name: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"message": message, "code": status}
    if field_name:
        body["field"] = field_name
    return JSONResponse({"error": body}, status_code=status)


class Upstream:
    """The server that serves now, read from `current.json` when the file changes."""

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / "current.json"
        self._stamp: tuple[int, int] | None = None
        self._endpoint: Endpoint | None = None

    def get(self) -> Endpoint | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._stamp, self._endpoint = None, None
            return None
        stamp = (st.st_mtime_ns, st.st_ino)
        if stamp != self._stamp:
            self._endpoint = Endpoint.from_dict(json.loads(self.path.read_text()))
            self._stamp = stamp
        return self._endpoint


class RateLimiter:
    """At most `per_minute` events per key in any 60 s window."""

    def __init__(self, per_minute: int, clock=time.monotonic):
        self.per_minute, self.clock = per_minute, clock
        self._events: dict[str, deque[float]] = defaultdict(deque)

    def allow(self, key: str) -> bool:
        now, events = self.clock(), self._events[key]
        while events and events[0] <= now - 60.0:
            events.popleft()
        if len(events) >= self.per_minute:
            return False
        events.append(now)
        return True


class BatchWriter:
    """One thread applies the gateway's store writes, all those waiting in one transaction
    (group commit): concurrent SQLite writers would queue on the file lock, each paying its own
    fsync, and SQLite's busy handler sleeps in steps of milliseconds. A write's future resolves
    only after the transaction holding it committed."""

    def __init__(self, store: FeedbackStore, max_batch: int = 256):
        self.store, self.max_batch = store, max_batch
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="feedback-store-writer", daemon=True)
        self._thread.start()

    def submit(self, call) -> Future:
        future: Future = Future()
        self._queue.put((call, future))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            batch = [item]
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(item)
            try:
                results = self.store.apply([call for call, _ in batch])
            except Exception as e:  # noqa: BLE001 - the commit failed: every write of the batch failed
                log.exception("a feedback store transaction failed")
                results = [e] * len(batch)
            for (_, future), result in zip(batch, results):
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)


@dataclass
class FeedbackRequest:
    response_id: str
    user: str
    choice_index: int = 0
    thumb: int | None = None
    score: float | None = None
    comment: str | None = None
    preferred: int | None = None


def parse_feedback(body: Any, header_user: str | None) -> FeedbackRequest:
    """A feedback body checked field by field; `BadRequest` names the first field at fault."""
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    if unknown := sorted(set(body) - FEEDBACK_FIELDS):
        raise BadRequest(unknown[0], f"unknown field; expected some of {sorted(FEEDBACK_FIELDS)}")
    rid = body.get("response_id")
    if not isinstance(rid, str) or not rid:
        raise BadRequest("response_id", "required: the id of the response being rated (a string)")
    user = body.get("user", header_user) or "anonymous"
    if not isinstance(user, str) or len(user) > 256:
        raise BadRequest("user", "must be a string of at most 256 characters")
    fb = FeedbackRequest(rid, user)
    rating, score, preferred = body.get("rating"), body.get("score"), body.get("preferred")
    if rating is not None:
        if rating not in ("up", "down"):
            raise BadRequest("rating", f'must be "up" or "down", got {rating!r}')
        fb.thumb = 1 if rating == "up" else -1
    if score is not None:
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not -1e6 < score < 1e6:
            raise BadRequest("score", f"must be a number, got {score!r}")
        fb.score = float(score)
    if preferred is not None:
        if isinstance(preferred, bool) or not isinstance(preferred, int):
            raise BadRequest("preferred", f"must be the index of the preferred answer, got {preferred!r}")
        if rating is not None or score is not None:
            raise BadRequest("preferred", "a choice between answers cannot also carry a rating or a score")
        fb.preferred = preferred
    if rating is None and score is None and preferred is None:
        raise BadRequest("rating", 'one of "rating", "score" or "preferred" is required')
    choice = body.get("choice_index", 0)
    if isinstance(choice, bool) or not isinstance(choice, int):
        raise BadRequest("choice_index", f"must be an integer, got {choice!r}")
    fb.choice_index = choice
    comment = body.get("comment")
    if comment is not None and (not isinstance(comment, str) or len(comment) > MAX_COMMENT):
        raise BadRequest("comment", f"must be a string of at most {MAX_COMMENT} characters")
    fb.comment = comment
    return fb


class Gateway:
    def __init__(self, store: FeedbackStore, state_dir: Path, api_key: str, salt: str, *,
                 ratings_per_minute: int = 60, max_samples: int = 4, upstream_timeout_s: float = 120.0):
        self.store, self.api_key, self.salt = store, api_key, salt
        self.upstream = Upstream(state_dir)
        self.limiter = RateLimiter(ratings_per_minute)
        self.max_samples = max_samples
        self.timeout_s = upstream_timeout_s
        self.session: aiohttp.ClientSession | None = None
        self.metrics = Metrics()
        self.metrics.registry.register(ThumbsCollector(store, Path(state_dir)))
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

    # --- serving --------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "/v1/completions", "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "/v1/chat/completions", "chat")

    async def _serve(self, request: Request, path: str, kind: str) -> Response:
        started = time.perf_counter()
        try:
            payload = json.loads(await request.body())
        except ValueError:
            return self._count(path, error(400, "the body is not valid JSON", "body"))
        if not isinstance(payload, dict):
            return self._count(path, error(400, "the body must be a JSON object", "body"))
        n = payload.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.max_samples:
            return self._count(path, error(400, f"must be an integer from 1 to {self.max_samples}, got {n!r}", "n"))
        endpoint = self.upstream.get()
        if endpoint is None:
            return self._count(path, error(503, "no model is being served (no current deployment)"))
        prompt = payload.get("messages") if kind == "chat" else payload.get("prompt")
        user_hash = hash_user(str(payload.get("user") or request.headers.get("x-user-id") or "anonymous"), self.salt)
        payload["model"] = endpoint.served_model_name
        t0 = time.perf_counter()
        try:
            upstream = await self.session.post(
                endpoint.url + path, data=json.dumps(payload).encode(),
                headers={"authorization": f"Bearer {self.api_key}", "content-type": "application/json"})
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return self._count(path, error(502, f"the served model at {endpoint.url} did not answer: {e!r}"))
        response_id = f"resp-{uuid.uuid4().hex}"
        record = dict(response_id=response_id, model_version=endpoint.version, served_model=endpoint.served_model_name,
                      kind=kind, prompt=prompt, user_hash=user_hash)
        if payload.get("stream"):
            return self._stream(path, upstream, response_id, record)
        async with upstream:
            content = await upstream.read()
        upstream_s = time.perf_counter() - t0
        if upstream.status != 200:
            return self._count(path, Response(content, upstream.status, media_type=upstream.content_type))
        data = json.loads(content)
        data["id"] = response_id
        answers = [Answer(_text(c, kind), c.get("finish_reason")) for c in sorted(data.get("choices", []),
                                                                                   key=lambda c: c.get("index", 0))]
        self._record(answers, record)
        self.metrics.added.labels(path).observe(max(time.perf_counter() - started - upstream_s, 0.0))
        return self._count(path, JSONResponse(data, headers={"x-response-id": response_id}))

    def _stream(self, path: str, upstream: aiohttp.ClientResponse, response_id: str, record: dict) -> Response:
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

        if upstream.status != 200:
            async def body():
                async with upstream:
                    yield await upstream.read()
            return self._count(path, StreamingResponse(body(), upstream.status, media_type=upstream.content_type))
        return self._count(path, StreamingResponse(events(), media_type="text/event-stream",
                                                   headers={"x-response-id": response_id}))

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
            body = json.loads(await request.body())
        except ValueError:
            self.metrics.rejected.labels("malformed").inc()
            return self._count(route, error(400, "the body is not valid JSON", "body"))
        try:
            fb = parse_feedback(body, request.headers.get("x-user-id"))
        except BadRequest as e:
            self.metrics.rejected.labels("malformed").inc()
            return self._count(route, error(400, str(e), e.field))
        user_hash = hash_user(fb.user, self.salt)
        if not self.limiter.allow(user_hash):
            self.metrics.rejected.labels("rate_limited").inc()
            self._log_limited(user_hash)
            return self._count(route, error(429, "too much feedback from this user; retry in a minute"))
        try:
            if fb.preferred is not None:
                recorded = await self._write(
                    lambda conn: self.store.choose(fb.response_id, user_hash, fb.preferred, fb.comment, conn=conn))
                kind = "choice"
            else:
                recorded = await self._write(
                    lambda conn: self.store.rate(fb.response_id, user_hash, choice_index=fb.choice_index,
                                                 thumb=fb.thumb, score=fb.score, comment=fb.comment, conn=conn))
                kind = {1: "up", -1: "down", None: "score"}[fb.thumb]
        except FeedbackError as e:
            self.metrics.rejected.labels("unknown_response" if e.status == 404 else "malformed").inc()
            field_name = "response_id" if e.status == 404 else str(e).split(":")[0]
            return self._count(route, error(e.status, str(e), field_name))
        if recorded.status == "duplicate":
            self.metrics.duplicates.inc()
        else:
            self.metrics.feedback.labels(recorded.model_version, kind).inc()
        return self._count(route, JSONResponse({"status": recorded.status, "response_id": fb.response_id}))

    def _log_limited(self, user_hash: str) -> None:
        now = time.monotonic()
        if now - self._limited_logged.get(user_hash, -1e9) >= 60:
            self._limited_logged[user_hash] = now
            log.warning("user %s sends more than %d ratings a minute; the excess is refused", user_hash,
                        self.limiter.per_minute)

    async def delete_user(self, request: Request) -> Response:
        user_hash = hash_user(request.path_params["user"], self.salt)
        deleted = await self._write(lambda conn: self.store.delete_user(user_hash, conn=conn))
        log.info("deleted the data of user %s: %s", user_hash, deleted)
        return JSONResponse({"deleted": deleted})

    # --- probes ---------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        endpoint = self.upstream.get()
        return JSONResponse({"status": "ok", "upstream": endpoint.url if endpoint else None,
                             "version": endpoint.version if endpoint else None})

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
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/feedback", self.feedback, methods=["POST"]),
            Route("/v1/users/{user}", self.delete_user, methods=["DELETE"]),
        ]
        return RequireApiKey(Starlette(routes=routes, lifespan=lifespan), key=self.api_key)


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
    """The gateway of a pipeline config: its store, the serving API key and state, and the salt
    for user ids (`feedback.salt_file`, else `<state_dir>/user_salt`, mode 0600)."""
    from rlhf_core.serving.auth import resolve_api_key, secret_file  # noqa: PLC0415
    from rlhf_core.serving.state import state_dir_for  # noqa: PLC0415

    state_dir = state_dir_for(cfg.serving, cfg.output_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    f = cfg.feedback
    salt = secret_file(Path(f.salt_file) if f.salt_file else state_dir / "user_salt")
    return Gateway(FeedbackStore(store_url(cfg)), state_dir, resolve_api_key(cfg.serving, state_dir), salt,
                   ratings_per_minute=f.ratings_per_minute, max_samples=f.max_samples,
                   upstream_timeout_s=f.upstream_timeout_s)


def run_gateway(cfg) -> None:
    """Serve the gateway in this process until it is stopped (SIGINT/SIGTERM)."""
    import uvicorn  # noqa: PLC0415

    gateway = build_gateway(cfg)
    if cfg.feedback.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("the feedback gateway binds to %s: it is reachable beyond this machine", cfg.feedback.host)
    try:
        uvicorn.run(gateway.app(), host=cfg.feedback.host, port=cfg.feedback.port, log_level="warning",
                    access_log=False, timeout_graceful_shutdown=10)
    finally:
        gateway.store.close()
