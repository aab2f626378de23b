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
    """`python -m flows.cli gateway *cli_args` in a session of its own; returns once its
    liveness probe, /livez, answers 200: the gateway's process is up. Whether anything serves
    behind it (its /health) is the caller's to check: a test may start one with no live
    upstream."""
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "gateway", *cli_args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/livez", timeout=1, trust_env=False).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise AssertionError(f"the gateway exited: {proc.stdout.read().decode()}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"the gateway did not answer /livez within {timeout_s:.0f} s")


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
