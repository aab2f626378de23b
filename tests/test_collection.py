"""The suite runs every test function written in the tree.

A `def test_...` that pytest does not collect never runs: glued to the end of a comment line,
nested in another function, or in a file pytest does not pick up. The source text is searched
with a regular expression rather than parsed, because a definition inside a comment is exactly
what a parser would miss too.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
DEFINITION = re.compile(r"def (test_\w+)\s*\(")  # no \b before def: it may follow a comment's last word


def written() -> dict[str, set[str]]:
    """Test function names per file (path relative to the repository), as the text defines them."""
    found = {}
    for path in sorted(TESTS.rglob("*.py")):
        names = set(DEFINITION.findall(path.read_text(encoding="utf-8")))
        if names:
            found[path.relative_to(REPO).as_posix()] = names
    return found


def by_file(node_ids) -> dict[str, set[str]]:
    """Test function names per file from pytest's test ids (parameters and classes dropped)."""
    found = defaultdict(set)
    for node_id in node_ids:
        if "::" in node_id:
            path, *_, name = node_id.split("::")
            found[path].add(name.split("[", 1)[0])
    return found


def collected(config: pytest.Config) -> dict[str, set[str]]:
    """Test function names per file, as pytest collects the whole tree: this session's own
    collection when it was of the whole tree (`make test`, `make test-fast`: tests/conftest.py
    keeps it before -m or -k deselect anything), else a `pytest --collect-only` of it."""
    [conftest] = [p for p in config.pluginmanager.get_plugins() if getattr(p, "__file__", None) == str(TESTS / "conftest.py")]
    whole_tree = [Path(a).resolve() for a in config.args] in ([TESTS], [REPO]) and not any(
        config.getoption(o) for o in ("ignore", "ignore_glob", "deselect"))
    if whole_tree and conftest.COLLECTED in config.stash:
        return by_file(config.stash[conftest.COLLECTED])
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return by_file(out.stdout.splitlines())


def test_every_test_function_in_the_tree_is_collected(pytestconfig):
    got = collected(pytestconfig)
    missing = {path: sorted(names - got.get(path, set())) for path, names in written().items()}
    assert {path: names for path, names in missing.items() if names} == {}


def test_the_source_search_finds_a_test_glued_to_a_comment():
    glued = "de" + "f test_hidden(serve):"  # split, so this file defines no such test itself
    text = f"    assert x  # a comment that ends here{glued}\n"
    assert DEFINITION.findall(text) == ["test_hidden"]


def test_the_slowest_modules_come_first_each_kept_whole_and_in_order(tmp_path):
    from tests.lanes import longest_modules_first, module_seconds

    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    durations = tmp_path / "durations.json"
    durations.write_text('{"modules": [{"module": "tests/b.py", "total": 300.0}, {"module": "tests/c.py", "total": 5.0}]}')
    seconds = module_seconds(durations)
    assert seconds == {"tests/b.py": 300.0, "tests/c.py": 5.0}
    items = [Item(n) for n in ("tests/a.py::t1", "tests/c.py::t1", "tests/b.py::t2", "tests/b.py::t1", "tests/c.py::t0")]
    longest_modules_first(items, seconds)
    assert [i.nodeid for i in items] == ["tests/b.py::t2", "tests/b.py::t1", "tests/c.py::t1", "tests/c.py::t0",
                                         "tests/a.py::t1"]  # unmeasured (a new module) last
    assert module_seconds(tmp_path / "none.json") == {} and module_seconds(tmp_path) == {}


def test_each_worker_runs_its_own_lane_first_then_the_rest_then_takes_from_the_other_lane():
    from tests.lanes import LANES, next_module

    lanes = (("a", "b"), ("c", "d"))
    queued = ["c", "a", "d", "x", "b", "y"]  # slowest first
    assert next_module(queued, 0, lanes) == "a" and next_module(queued, 1, lanes) == "c"
    assert next_module(["d", "x", "y"], 0, lanes) == "x"  # its lane done: the slowest of no lane
    assert next_module(["c", "d"], 0, lanes) == "d"  # nothing else: the other lane's last
    assert next_module(["c", "d", "x"], 2, lanes) == "x"  # a worker with no lane
    # make test's lanes: each module once, every one of them a module of the tree
    laned = [module for lane in LANES for module in lane]
    assert len(laned) == len(set(laned)) and all((REPO / module).is_file() for module in laned)


def test_the_lane_scheduler_hands_each_worker_its_lane_then_shares_the_rest():
    """pytest-xdist's own loadfile scheduler, driven as its controller drives it, with the lanes'
    choice in: two workers, each test reported done in turn."""
    from types import SimpleNamespace

    from tests.lanes import lane_scheduler

    class Config:
        option = SimpleNamespace(loadscopereorder=False)

        def __init__(self, **values):
            self.values = {"tx": ["2*popen"], "dist": "loadfile", "numprocesses": 2} | values

        def getvalue(self, name):
            return self.values[name]

    class Worker:
        def __init__(self, name):
            self.gateway, self.shutting_down, self.pending, self.ran = SimpleNamespace(id=name), False, [], []

        def send_runtest_some(self, indices):
            self.pending += indices

        def shutdown(self):
            self.shutting_down = True

    lanes = (("tests/a.py", "tests/b.py"), ("tests/c.py",))
    modules = ["tests/c.py", "tests/a.py", "tests/x.py", "tests/b.py", "tests/y.py"]  # slowest first
    collection = [f"{module}::t{i}" for module in modules for i in range(3)]
    assert lane_scheduler(Config(numprocesses=3), lanes=lanes) is None  # not make test's two workers
    assert lane_scheduler(Config(dist="load"), lanes=lanes) is None
    scheduler = lane_scheduler(Config(), lanes=lanes)
    workers = [Worker("gw0"), Worker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    while any(worker.pending for worker in workers):
        for worker in workers:
            if worker.pending:
                index = worker.pending.pop(0)
                worker.ran.append(collection[index].split("::")[0])
                scheduler.mark_test_complete(worker, index)
    ran = [list(dict.fromkeys(worker.ran)) for worker in workers]
    assert ran[0][:2] == ["tests/a.py", "tests/b.py"] and ran[1][0] == "tests/c.py"
    assert sorted(ran[0] + ran[1]) == sorted(modules) and sum(len(w.ran) for w in workers) == len(collection)
