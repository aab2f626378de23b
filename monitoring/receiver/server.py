"""HTTP: `POST /alerts` and `GET /healthz` on a threading server in front of a `Receiver`."""
from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Mapping

from monitoring.receiver.core import Receiver
from monitoring.receiver.payload import PayloadError, parse_payload

log = logging.getLogger("rlhf.receiver")

MAX_BODY_BYTES = 1 << 20


class _Handler(BaseHTTPRequestHandler):
    server: "ReceiverServer"
    server_version = "rlhf-receiver"
    timeout = 30  # seconds a client may stall mid-request before its thread gives up
    protocol_version = "HTTP/1.1"

    @property
    def client(self) -> str:
        host, port = self.client_address[:2]
        return f"{host}:{port}"

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's name
        log.debug("%s %s", self.client, format % args)

    def _send(self, status: int, body: dict, headers: Mapping[str, str] | None = None, close: bool = False) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if close:  # the request body was not read: the connection cannot carry another request
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _refuse(self, status: int, why: str, headers: Mapping[str, str] | None = None, close: bool = True) -> None:
        self.server.receiver.reject(self.client, status, why, method=self.command, path=self.path[:200])
        self._send(status, {"status": "rejected", "error": why}, headers, close)

    def do_GET(self) -> None:  # noqa: N802
        if self.path.split("?")[0] == "/healthz":
            self._send(HTTPStatus.OK, {"status": "ok"})
        else:
            self._send(HTTPStatus.NOT_FOUND, {"status": "rejected", "error": "not found"})

    def do_POST(self) -> None:  # noqa: N802
        receiver = self.server.receiver
        if self.path.split("?")[0] != "/alerts":
            return self._refuse(HTTPStatus.NOT_FOUND, f"no such endpoint: POST {self.path[:200]}")
        why = receiver.auth_failure(self.headers.get("Authorization"))
        if why is not None:
            return self._refuse(HTTPStatus.UNAUTHORIZED, why, {"WWW-Authenticate": 'Bearer realm="rlhf-receiver"'})
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            return self._refuse(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required")
        if int(length) > MAX_BODY_BYTES:
            return self._refuse(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                f"body of {int(length)} bytes is over the {MAX_BODY_BYTES}-byte limit")
        body = self.rfile.read(int(length))
        try:
            payload = parse_payload(body)
        except PayloadError as exc:
            return self._refuse(HTTPStatus.BAD_REQUEST, str(exc), close=False)
        try:
            response = receiver.handle(payload, self.client)
        except Exception as exc:  # noqa: BLE001 - state dir broken etc.: answer 500 so Alertmanager retries
            log.exception(json.dumps({"event": "error", "client": self.client, "error": repr(exc)[:500]}))
            return self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"status": "error", "error": type(exc).__name__})
        self._send(response.status, response.body)


class ReceiverServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], receiver: Receiver):
        self.receiver = receiver
        super().__init__(address, _Handler)


def serve_in_thread(
    receiver: Receiver, host: str = "127.0.0.1", port: int = 0
) -> tuple[ReceiverServer, threading.Thread]:
    """Start serving in a daemon thread; `server.server_address` has the bound port.
    Stop with `server.shutdown(); server.server_close()`."""
    server = ReceiverServer((host, port), receiver)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              name="rlhf-receiver", daemon=True)
    thread.start()
    return server, thread
