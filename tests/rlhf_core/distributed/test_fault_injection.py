"""The points where the resume and concurrency tests stop or order a run: inert unless the one
switch, $RLHF_FAULT, names them, and refused in a deployment's run."""
from __future__ import annotations

import logging
import re
import threading
import time

import pytest

from rlhf_core.distributed import fault_injection
from rlhf_core.distributed.fault_injection import FAULT_ENV, Fault, fault_point, parse, skipped
from tasks.run_start import FaultRefused, refuse_in_deployment


def test_the_points_do_nothing_unless_the_switch_names_them(tmp_path, monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    fault_point("reward:checkpoint")
    fault_point("register:promote")
    monkeypatch.setenv(FAULT_ENV, f"wait:register:other={tmp_path / 'go'}")  # another point
    fault_point("register:promote")
    monkeypatch.setenv(FAULT_ENV, "hold:policy:checkpoint")
    fault_point("reward:checkpoint")
    assert list(tmp_path.iterdir()) == []


def test_the_switch_is_parsed_once_and_said_loudly(caplog):
    parse.cache_clear()
    with caplog.at_level(logging.WARNING, logger=fault_injection.__name__):
        assert parse("kill:sft:end") == Fault("kill", "sft:end")
        assert parse("kill:sft:end") == Fault("kill", "sft:end")
        assert parse("wait:register:promote=/tmp/go") == Fault("wait", "register:promote", fault_injection.Path("/tmp/go"))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "fault injection armed ($RLHF_FAULT=kill:sft:end)" in said[0]
    assert parse("") is None and parse(None) is None


@pytest.mark.parametrize("value", ["explode:sft:end", "kill:", "wait:register:promote", "hold:sft:end=/tmp/go",
                                   "skip:policy:sync=/tmp/go"])
def test_a_malformed_switch_says_what_it_takes(value):
    with pytest.raises(ValueError, match=re.escape(
            "expected kill:POINT[=FILE], hold:POINT, nan:POINT, skip:POINT or wait:POINT=FILE")):
        parse(value)


def test_a_skip_names_one_point_and_the_point_itself_does_nothing(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "skip:policy:sync")
    assert skipped("policy:sync") and not skipped("reward:sync")
    fault_point("policy:sync")  # a skip is the caller's to act on: the point neither kills nor waits
    monkeypatch.delenv(FAULT_ENV)
    assert not skipped("policy:sync")


def test_a_deployments_run_refuses_an_armed_switch(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "kill:sft:end")
    refuse_in_deployment()  # a run started directly (a test, `rlhf run`): armed, and said
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", "a7c1f0e2-deployment")  # Prefect's own runtime mock
    with pytest.raises(FaultRefused, match="a deployment's run refuses it"):
        refuse_in_deployment()
    monkeypatch.delenv(FAULT_ENV)
    refuse_in_deployment()


def test_a_wait_point_says_it_waits_and_goes_on_once_its_file_exists(tmp_path, monkeypatch):
    go = tmp_path / "go"
    monkeypatch.setenv(FAULT_ENV, f"wait:register:promote={go}")
    waiter = threading.Thread(target=fault_point, args=("register:promote",))
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
    monkeypatch.setenv(FAULT_ENV, f"wait:register:promote={tmp_path / 'go'}")
    with pytest.raises(TimeoutError, match="go did not appear within 0 s"):
        fault_point("register:promote", wait_s=0.3)
