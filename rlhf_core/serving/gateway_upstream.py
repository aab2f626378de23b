"""The server the gateway sends to: the one `<state_dir>/current.json` names now, and whether it
answers its health check."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import aiohttp

from rlhf_core.serving.state import Endpoint

log = logging.getLogger(__name__)


class Upstream:
    """The server that serves now, read from `current.json` when the file changes."""

    health_ttl_s = 1.0  # an answer to the upstream's /health is reused this long: probes cannot flood it
    health_timeout_s = 2.0

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / "current.json"
        self._stamp: tuple[int, int] | None = None
        self._endpoint: Endpoint | None = None
        self._health: tuple[str, float, bool] | None = None  # (url, checked at, healthy)

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
