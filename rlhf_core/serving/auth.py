"""The serving API key: where it comes from, and the check the server runs on every request.

The key: `$<cfg.api_key_env>` if set, else `<state_dir>/api_key`, generated once (mode 0600)
and reused. The server gets it through `VLLM_API_KEY` in its environment, never on its
command line, where `ps` would show it. vLLM checks the key only under `/v1`, `/v2`,
`/inference` and `/cohere`: its SageMaker route `POST /invocations` (always registered) runs
completions without one. `RequireApiKey`, added with `--middleware`, closes that: with it
every path but `/health` and `/metrics` needs the key. Binding to 127.0.0.1 (the default
`cfg.host`) remains the real boundary; any other host exposes the API.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import tempfile
from pathlib import Path

from rlhf_core.config import ServingConfig
from rlhf_core.serving.errors import ServingError

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics")  # answered without the key (probes, Prometheus)


def resolve_api_key(cfg: ServingConfig, state_dir: Path) -> str:
    """$<cfg.api_key_env> if set and non-empty; else the key in <state_dir>/api_key, generated
    (mode 0600) on first use."""
    if key := os.environ.get(cfg.api_key_env, ""):
        return key
    return secret_file(Path(state_dir) / "api_key")


def secret_file(path: Path) -> str:
    """The secret in `path`, generated (mode 0600) on first use. Concurrent first calls agree:
    the file is created with `os.link`, which fails if another caller created it first, and
    everyone reads it back."""
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mkstemp: mode 0600
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
    secret = path.read_text().strip()
    if not secret:
        raise ServingError(f"{path} is empty; delete it to generate a new one")
    return secret


class RequireApiKey:
    """ASGI middleware loaded into the vLLM server (`--middleware`): every request except to
    OPEN_PATHS (or the `open_paths` given) needs `Authorization: Bearer $VLLM_API_KEY` (or the
    `key` given, as the feedback gateway gives them). vLLM's own check skips paths
    outside /v1, /v2, /inference, /cohere, e.g. POST /invocations. Fails closed: without
    VLLM_API_KEY only OPEN_PATHS answer."""

    def __init__(self, app, key: str | None = None, open_paths: tuple[str, ...] = OPEN_PATHS):
        self.app, self.open_paths = app, open_paths
        key = os.environ.get("VLLM_API_KEY", "") if key is None else key
        self._digest = hashlib.sha256(key.encode()).digest() if key else None

    def _authorised(self, scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        if self._digest is None or scheme.lower() != "bearer":
            return False
        return secrets.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")).rstrip("/") or "/"
        if scope["type"] not in ("http", "websocket") or path in self.open_paths or self._authorised(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = b'{"error":"Unauthorized"}'
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
