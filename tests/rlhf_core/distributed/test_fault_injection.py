"""The points where the resume and concurrency tests stop or order a run: inert unless their
variable names them."""
from __future__ import annotations

import threading
import time

import pytest

from rlhf_core.distributed.fault_injection import HOLD_ENV, WAIT_ENV, hold_point, wait_point


def test_the_points_do_nothing_unless_their_variable_names_them(tmp_path, monkeypatch):
    monkeypatch.delenv(HOLD_ENV, raising=False)
    monkeypatch.delenv(WAIT_ENV, raising=False)
    hold_point("reward:checkpoint")
    wait_point("register:promote")
    monkeypatch.setenv(HOLD_ENV, "policy:checkpoint")  # another point
    monkeypatch.setenv(WAIT_ENV, f"register:other={tmp_path / 'go'}")
    hold_point("reward:checkpoint")
    wait_point("register:promote")
    assert list(tmp_path.iterdir()) == []


def test_a_wait_point_says_it_waits_and_goes_on_once_its_file_exists(tmp_path, monkeypatch):
    go = tmp_path / "go"
    monkeypatch.setenv(WAIT_ENV, f"register:promote={go}")
    waiter = threading.Thread(target=wait_point, args=("register:promote",))
    waiter.start()
    deadline = time.monotonic() + 10
    while not (tmp_path / "go.waiting").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "go.waiting").exists()
    time.sleep(0.5)
    assert waiter.is_alive()  # still waiting: no go yet
    go.touch()
    waiter.join(5)
    assert not waiter.is_alive()


def test_a_wait_point_whose_file_never_comes_fails_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv(WAIT_ENV, f"register:promote={tmp_path / 'go'}")
    with pytest.raises(TimeoutError, match="go did not appear within 0 s"):
        wait_point("register:promote", timeout_s=0.3)
