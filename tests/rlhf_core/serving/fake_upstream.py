"""A stand-in for the vLLM server behind the gateway, on a real loopback port: it answers
/health and completions, and records every request it was sent."""
from __future__ import annotations

import json
import socket
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rlhf_core.serving.state import announce


@dataclass
class FakeUpstream:
    url: str
    requests: list[tuple[str, str, int]] = field(default_factory=list)  # (method, path, body bytes)
    health_status: int = 200
    completion_status: int = 200
    completion_error: str = ""  # the body of a completion answered other than 200

    def completions(self) -> list[tuple[str, str, int]]:
        return [r for r in self.requests if r[1] != "/health"]


def _handler(fake: FakeUpstream):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            fake.requests.append(("GET", self.path, 0))
            self._answer(fake.health_status, b"")

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            fake.requests.append(("POST", self.path, len(body)))
            if fake.completion_status != 200:
                return self._answer(fake.completion_status, fake.completion_error.encode(), "text/plain")
            payload = json.loads(body)
            chat = self.path.endswith("/chat/completions")
            choices = [{"index": i, "finish_reason": "length",
                        **({"message": {"role": "assistant", "content": "046"}} if chat else {"text": "046"})}
                       for i in range(payload.get("n", 1))]
            self._answer(200, json.dumps({"id": "cmpl-upstream", "object": "text_completion", "created": 0,
                                          "model": payload["model"], "choices": choices}).encode())

    return Handler


@contextmanager
def fake_upstream(state_dir: Path, version: str = "1"):
    """A `FakeUpstream` serving on a free loopback port, announced in `state_dir/current.json`."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), None)
    fake = FakeUpstream(url=f"http://127.0.0.1:{server.server_address[1]}")
    server.RequestHandlerClass = _handler(fake)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)  # quick shutdown
    thread.start()
    announce(state_dir, url=fake.url, served_model_name=f"policy-v{version}", version=version, model_dir="/m")
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()


def announce_dead_upstream(state_dir: Path, version: str = "1") -> str:
    """Announce a server on a loopback port nothing listens on; returns its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    announce(state_dir, url=url, served_model_name=f"policy-v{version}", version=version, model_dir="/m")
    return url
