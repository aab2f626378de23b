"""Free loopback ports for the servers a test or a benchmark starts."""
from __future__ import annotations

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
    before the test's server binds it; a port below the range only goes to who asks for it."""
    low = min(_ephemeral_range()[0], 32768)
    candidates = random.Random().sample(range(20000, low), min(400, low - 20000))
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
