"""A directory of its own for the files a vLLM engine or server leaves in the temp directory.

vLLM names its processes' ZeroMQ sockets `<VLLM_RPC_BASE_PATH>/<uuid>` (the temp directory
unless set) and never unlinks them, and its CPU backend meets its worker through a
`vllm_dist_<hex>` file there that a stopped server leaves behind (vLLM 0.32). Measured on the
tiny policy: a rollout engine left 4 socket files in /tmp after a clean `close()`, a server 3
and its rendezvous file after its stop, and one run of the test suite about 130.

Here each vLLM server gets a directory `rlhf-vllm-*` of its own, and each process that holds
rollout engines one for all of them (`rlhf-vllm-<pid>`: vLLM caches its settings once an
engine core has started in a process, so the path must stay the same for that process). An
`owner` file names the process the directory serves (`rlhf_core.process_owner`). The directory
is removed once that process is gone: by whoever stops the server or closes the process's last
engine, or else (a killed process) by the next `sweep()`, which every server launch and stop
and every engine start runs.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhf_core.process_owner import owner_gone, owner_of

PREFIX = "rlhf-vllm-"
OWNER = "owner"
UNCLAIMED_GRACE_S = 300.0  # a directory made for a server whose pid is not written yet: being launched
SOCKET_PATH_MAX = 107  # sun_path of a Unix socket, less its terminating NUL
UUID_NAME = 37  # "/" and a uuid4: the name vLLM gives each socket


def root() -> Path:
    return Path(tempfile.gettempdir())


def fits(path: Path) -> bool:
    """vLLM's socket paths under `path` stay within a Unix socket's path limit."""
    return len(os.fsencode(str(path))) + UUID_NAME <= SOCKET_PATH_MAX


def claim(path: Path, pid: int) -> None:
    """Record `pid` as the process `path` serves (written whole, or not at all)."""
    tmp = path / f".{OWNER}.{os.getpid()}"
    tmp.write_text(owner_of(pid))
    os.replace(tmp, path / OWNER)


def new_dir() -> Path | None:
    """A new directory for a server, claimed once its pid is known (`claim`); None where its
    sockets' paths would be too long (vLLM then uses the temp directory)."""
    if not fits(root() / f"{PREFIX}xxxxxxxx"):
        return None
    return Path(tempfile.mkdtemp(prefix=PREFIX, dir=root()))


def process_dir() -> Path | None:
    """This process's directory for its rollout engines, made and claimed if it is not."""
    path = root() / f"{PREFIX}{os.getpid()}"
    if not fits(path):
        return None
    path.mkdir(mode=0o700, exist_ok=True)
    if not (path / OWNER).exists():
        claim(path, os.getpid())
    return path


def remove(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def sweep(directory: Path | None = None) -> list[Path]:
    """Remove the directories whose process is gone, and those never claimed for
    UNCLAIMED_GRACE_S (a launch that died before it wrote the pid). Returns what it removed."""
    removed = []
    for path in sorted((directory or root()).glob(f"{PREFIX}*")):
        try:
            owner = (path / OWNER).read_text()
        except FileNotFoundError:
            owner = None
        except OSError:  # not ours to read: leave it
            continue
        try:
            unclaimed_for = time.time() - path.stat().st_mtime
        except OSError:
            continue
        if owner_gone(owner) if owner else unclaimed_for > UNCLAIMED_GRACE_S:
            remove(path)
            removed.append(path)
    return removed


_open_engines = 0  # the open engines of this process whose sockets are in its directory


@contextmanager
def engine_start() -> Iterator[Path | None]:
    """Around the start of a rollout engine in this process: vLLM's sockets go to the process's
    directory, unless VLLM_RPC_BASE_PATH is set outside. Yields that directory (None: not used),
    which the engine hands to `engine_closed` when it closes, started or not."""
    global _open_engines
    sweep()
    path = None if "VLLM_RPC_BASE_PATH" in os.environ else process_dir()
    if path is None:
        yield None
        return
    _open_engines += 1
    os.environ["VLLM_RPC_BASE_PATH"] = str(path)
    try:
        yield path
    finally:
        os.environ.pop("VLLM_RPC_BASE_PATH", None)


def engine_closed(path: Path | None) -> None:
    """An engine started with `path` closed: the directory goes with the process's last one."""
    global _open_engines
    if path is not None:
        _open_engines -= 1
        if _open_engines == 0:
            remove(path)
