"""`rlhf gateway` as its own process, for the tests that need a real one."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]  # the checkout: `python -m flows.cli` runs from it


def start_gateway(cli_args: list[str], port: int, timeout_s: float = 60) -> subprocess.Popen:
    """`python -m flows.cli gateway *cli_args` in a session of its own; returns once /health answers."""
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "gateway", *cli_args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
        if proc.poll() is not None:
            raise AssertionError(f"the gateway exited: {proc.stdout.read().decode()}")
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"the gateway did not answer /health within {timeout_s:.0f} s")


def stop_gateway(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


@contextmanager
def running_gateway(cli_args: list[str], port: int):
    proc = start_gateway(cli_args, port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_gateway(proc)
