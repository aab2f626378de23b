"""Who holds a claim, and whether they still live: `host:pid:start`, where `start` is the
process's start time in clock ticks since boot (/proc/<pid>/stat, field 22), which tells a
live process from a later one that reused its pid.

The receiver names the owner of each rollback it claims, and the pipeline the owner of each
MLflow run it opens, so that whoever comes next can tell work in progress from work a killed
process left behind.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path


def process_start(pid: int) -> str | None:
    """The start time of `pid`, or None if there is no such process."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat_line[stat_line.rindex(")") + 2:].split()[19]  # comm may hold spaces and ")"


def this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{process_start(os.getpid())}"


def owner_gone(owner: str | None) -> bool:
    """True when `owner` was a process on this host that no longer runs. Owners on other
    hosts (or unknown ones) are never presumed gone."""
    if not owner or owner.count(":") < 2:
        return False
    host, pid, start = owner.rsplit(":", 2)
    if host != socket.gethostname() or not pid.isdigit():
        return False
    return process_start(int(pid)) != start
