"""Free ports for the tests' servers: below the kernel's ephemeral range, and under pytest-xdist
never the same for two workers."""
from __future__ import annotations

import pytest

from rlhf_core.testing import ports


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, (0, 1)),
    ({"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}, (1, 2)),
    ({"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_WORKER_COUNT": "4"}, (0, 4)),
    ({"PYTEST_XDIST_WORKER": "master", "PYTEST_XDIST_WORKER_COUNT": "2"}, (0, 1)),
    ({"PYTEST_XDIST_WORKER": "gw1"}, (0, 1)),  # a worker name without a count: one pool
])
def test_each_xdist_worker_has_its_own_stripe(environ, expected):
    assert ports._xdist_worker(environ) == expected


def test_two_workers_draw_disjoint_ports_below_the_ephemeral_range(monkeypatch):
    drawn = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        drawn[worker] = ports.free_ports(50)
    low = min(ports._ephemeral_range()[0], 32768)
    assert all(20000 <= p < low for ps in drawn.values() for p in ps)
    assert {p % 2 for p in drawn["gw0"]} == {0} and {p % 2 for p in drawn["gw1"]} == {1}
    assert len(set(drawn["gw0"])) == 50
