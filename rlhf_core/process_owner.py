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
    """The start time of `pid`, or None if there is no such process or it has exited and waits
    to be reaped (a zombie: an orphan's can wait long for init)."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat_line[stat_line.rindex(")") + 2:].split()  # comm may hold spaces and ")"
    return None if fields[0] == "Z" else fields[19]


def owner_of(pid: int) -> str:
    return f"{socket.gethostname()}:{pid}:{process_start(pid)}"


def this_process() -> str:
    return owner_of(os.getpid())


def owner_gone(owner: str | None) -> bool:
    """True when `owner` was a process on this host that no longer runs. Owners on other
    hosts (or unknown ones) are never presumed gone."""
    if not owner or owner.count(":") < 2:
        return False
    host, pid, start = owner.rsplit(":", 2)
    if host != socket.gethostname() or not pid.isdigit():
        return False
    return process_start(int(pid)) != start
