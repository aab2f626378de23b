"""The gateway's limits: ratings per user per minute, and the size of a request body."""
from __future__ import annotations

import time
from collections import defaultdict, deque

from starlette.requests import Request


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


class BodyTooLarge(Exception):
    """A request body over its route's limit (413)."""

    def __init__(self, limit: int):
        super().__init__(f"larger than this endpoint's limit of {limit} bytes")
        self.limit = limit


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most `limit` bytes: `BodyTooLarge` as soon as the declared
    Content-Length, or the bytes received so far of a chunked body, exceed it. Nothing past the
    chunk that crosses the limit is read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)
