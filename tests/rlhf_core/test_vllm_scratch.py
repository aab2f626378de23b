"""The directories that hold the files vLLM leaves in the temp directory: each is removed once
the process it serves is gone, and never while it lives or is being launched."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rlhf_core import vllm_scratch
from rlhf_core.process_owner import this_process


@pytest.fixture
def tmp_root(monkeypatch):
    """A temp directory of this test's own, short enough for socket paths (tmp_path is not)."""
    root = Path(tempfile.mkdtemp(prefix="scratch-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    shutil.rmtree(root)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_sweep_removes_what_a_gone_process_or_a_launch_that_died_left_and_nothing_else(tmp_root):
    gone = vllm_scratch.new_dir()
    (gone / "4a1b5e0c-socket").write_text("")
    vllm_scratch.claim(gone, dead_pid())
    alive = vllm_scratch.new_dir()
    vllm_scratch.claim(alive, os.getpid())
    mine = vllm_scratch.process_dir()
    launching = vllm_scratch.new_dir()  # not claimed yet: its server is being started
    abandoned = vllm_scratch.new_dir()  # never claimed, long ago: its launch died
    old = time.time() - vllm_scratch.UNCLAIMED_GRACE_S - 1
    os.utime(abandoned, (old, old))
    elsewhere = vllm_scratch.new_dir()  # another host's process: never presumed gone
    (elsewhere / vllm_scratch.OWNER).write_text(f"another-host:{dead_pid()}:1")
    unrelated = tmp_root / "vllm-something-else"
    unrelated.mkdir()

    assert sorted(vllm_scratch.sweep()) == sorted([gone, abandoned])
    assert not gone.exists() and not abandoned.exists()
    assert all(p.is_dir() for p in (alive, mine, launching, elsewhere, unrelated))
    assert mine == tmp_root / f"rlhf-vllm-{os.getpid()}" and (mine / "owner").read_text() == this_process()
    assert vllm_scratch.process_dir() == mine and vllm_scratch.sweep() == []


def test_a_zombie_owner_counts_as_gone(tmp_root):
    """A stopped server's leader stays a zombie until its parent reaps it."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        path = vllm_scratch.new_dir()
        vllm_scratch.claim(path, proc.pid)
        assert vllm_scratch.sweep() == [path]
    finally:
        proc.wait()


def test_a_temp_directory_too_long_for_vllms_socket_paths_gets_none(tmp_path, monkeypatch):
    long_root = tmp_path / ("d" * (vllm_scratch.SOCKET_PATH_MAX - len(str(tmp_path))))
    monkeypatch.setattr(tempfile, "tempdir", str(long_root))
    assert vllm_scratch.new_dir() is None and vllm_scratch.process_dir() is None
    assert not long_root.exists()


def test_the_process_directory_goes_with_its_last_engine_and_an_outside_rpc_path_wins(tmp_root, monkeypatch):
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    monkeypatch.setattr(vllm_scratch, "_open_engines", 0)  # engines other tests of this process left open
    with vllm_scratch.engine_start() as first:
        assert os.environ["VLLM_RPC_BASE_PATH"] == str(first)  # while the engine starts
    assert "VLLM_RPC_BASE_PATH" not in os.environ
    with vllm_scratch.engine_start() as second:
        pass
    assert first == second == tmp_root / f"rlhf-vllm-{os.getpid()}"  # one a process: vLLM caches the setting
    vllm_scratch.engine_closed(first)
    assert second.is_dir()  # the other engine still runs
    vllm_scratch.engine_closed(second)
    assert not second.exists()
    vllm_scratch.engine_closed(None)  # an engine that used none

    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/run/vllm")
    with vllm_scratch.engine_start() as outside:
        assert outside is None and os.environ["VLLM_RPC_BASE_PATH"] == "/run/vllm"
    assert os.environ["VLLM_RPC_BASE_PATH"] == "/run/vllm" and list(tmp_root.iterdir()) == []
