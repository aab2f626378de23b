"""Free loopback ports for the servers a test or a benchmark starts."""
from __future__ import annotations

import os
import random
import socket
from pathlib import Path


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out to `bind(port 0)` and outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports that were free a moment ago, below the kernel's ephemeral
    range. A port from `bind(port 0)` comes from that range, so any process of the run (a Ray
    worker, a vLLM engine, a client's connection) may be handed the same port by the kernel
    before the test's server binds it; a port below the range only goes to who asks for it.
    Under pytest-xdist each worker draws from its own residue class of the range, so two
    workers never pick the same port between checking it and binding it."""
    low = min(_ephemeral_range()[0], 32768)
    worker, workers = _xdist_worker(os.environ)
    pool = range(20000 + worker, low, workers)
    candidates = random.Random().sample(pool, min(400, len(pool)))
    ports: list[int] = []
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"no {n} free loopback ports between 20000 and {low}")


def _xdist_worker(environ) -> tuple[int, int]:
    """(this pytest-xdist worker's index, the number of workers); (0, 1) outside xdist."""
    name, count = environ.get("PYTEST_XDIST_WORKER", ""), environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if name.startswith("gw") and name[2:].isdigit() and count.isdigit() and int(count) > 0:
        return int(name[2:]) % int(count), int(count)
    return 0, 1
