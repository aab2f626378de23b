"""The server the gateway sends to: the one `<state_dir>/current.json` names now, and whether it
answers its health check."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import aiohttp

from rlhf_core.serving.canary import CANARY, Canary, routed_to_canary
from rlhf_core.serving.state import Endpoint

log = logging.getLogger(__name__)


class _Watched:
    """A JSON file read again only when it changes; None while it does not exist."""

    def __init__(self, path: Path, parse):
        self.path, self.parse = path, parse
        self._stamp: tuple[int, int] | None = None
        self._value = None

    def get(self):
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._stamp, self._value = None, None
            return None
        stamp = (st.st_mtime_ns, st.st_ino)
        if stamp != self._stamp:
            self._value = self.parse(json.loads(self.path.read_text()))
            self._stamp = stamp
        return self._value


class Upstream:
    """The server that serves now, read from `current.json` when the file changes, and the
    canary beside it (`canary.json`) for the share of users routed to it."""

    health_ttl_s = 1.0  # an answer to the upstream's /health is reused this long: probes cannot flood it
    health_timeout_s = 2.0

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / "current.json"
        self._current = _Watched(self.path, Endpoint.from_dict)
        self._canary = _Watched(Path(state_dir) / CANARY, Canary.from_dict)
        self._health: tuple[str, float, bool] | None = None  # (url, checked at, healthy)

    def get(self, user_hash: str | None = None) -> Endpoint | None:
        """The champion's endpoint; the canary's for a user routed to it (`routed_to_canary`)."""
        champion = self._current.get()
        canary = self.canary() if user_hash is not None and champion is not None else None
        if canary is not None and routed_to_canary(user_hash, canary.endpoint.version, canary.share):
            return canary.endpoint
        return champion

    def canary(self) -> Canary | None:
        return self._canary.get()

    async def healthy(self, session: aiohttp.ClientSession, endpoint: Endpoint) -> bool:
        """Whether `endpoint`'s /health answers 200; a failure is logged (with its URL and
        error) when the upstream turns unhealthy, never returned."""
        now = time.monotonic()
        if self._health and self._health[0] == endpoint.url and now - self._health[1] < self.health_ttl_s:
            return self._health[2]
        try:
            async with session.get(endpoint.url + "/health",
                                   timeout=aiohttp.ClientTimeout(total=self.health_timeout_s)) as r:
                ok, why = r.status == 200, f"status {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            ok, why = False, repr(e)
        was_ok = self._health is None or self._health[2]
        if not ok and was_ok:
            log.warning("the served model at %s (version %s) fails its health check: %s", endpoint.url,
                        endpoint.version, why)
        self._health = (endpoint.url, now, ok)
        return ok
