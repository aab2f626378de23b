"""Sizes a reader can hold: no module outside the tests over 400 lines, no function over 80.
A module that grows past them has more than one job; split it by job, not by line count."""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("rlhf_core", "tasks", "flows", "monitoring", "bench", "infra")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _sources():
    return sorted(p for folder in FOLDERS for p in (REPO / folder).rglob("*.py"))


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def test_the_sources_are_found():
    assert len(_sources()) > 100


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_module_over_400_lines_and_no_function_over_80(folder):
    too_long = {}
    for path in (p for p in _sources() if p.relative_to(REPO).parts[0] == folder):
        lines = len(path.read_text().splitlines())
        problems = ([f"{lines} lines"] if lines > MAX_MODULE_LINES else []) + long_functions(path)
        if problems:
            too_long[str(path.relative_to(REPO))] = problems
    assert too_long == {}


def test_the_function_check_measures_from_def_to_last_line(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def short():\n    return 1\n\n\ndef long():\n" + "    x = 1\n" * 5 + "    return x\n")
    assert long_functions(path, limit=5) == ["long (7 lines)"]
    assert long_functions(path, limit=7) == []
