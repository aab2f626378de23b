"""infra/scripts/pick-python.sh: which interpreter a new .venv is made with. Fake interpreters on
a PATH of their own report their loop's seconds; the real ones are probed once, for what the
script prints about them."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "infra" / "scripts" / "pick-python.sh"


def fake(bin_dir: Path, name: str, seconds: float | None, version: str = "3.11.9",
         real: Path | None = None) -> Path:
    """An executable `name` in `bin_dir` that answers the script's probe as an interpreter whose
    loop took `seconds` (None: one that refuses, as a Python 3.9 or one without venv would)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / name
    answer = "exit 1" if seconds is None else f'echo "{seconds:.4f} {version} {real or exe}"'
    exe.write_text(f"#!/bin/sh\n{answer}\n")
    exe.chmod(0o755)
    return exe


def pick(path_dirs: list[Path]) -> subprocess.CompletedProcess:
    """The script with `path_dirs` and the tools it uses (awk, readlink) on PATH, and no other
    interpreter."""
    tools = path_dirs[0].parent / "tools"
    tools.mkdir(exist_ok=True)
    for tool in ("awk", "readlink"):
        if not (tools / tool).exists():
            (tools / tool).symlink_to(shutil.which(tool))
    env = {**os.environ, "PATH": os.pathsep.join([*map(str, path_dirs), str(tools)])}
    return subprocess.run([shutil.which("bash"), str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


def test_the_first_on_path_wins_unless_another_is_more_than_ten_percent_faster(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    first = fake(a, "python3", 0.1000)
    fake(b, "python3.11", 0.0950)  # 5% faster: not enough to leave the first
    done = pick([a, b])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(first)
    assert f"{first} (3.11.9): 0.1000 s" in done.stderr

    faster = fake(b, "python3.11", 0.0800)  # 20% faster
    done = pick([a, b])
    assert done.stdout.strip() == str(faster), done.stderr
    assert "The interpreter for the new .venv: " + str(faster) in done.stderr


def test_one_interpreter_under_several_names_is_measured_once_and_refusers_are_left_out(tmp_path):
    a = tmp_path / "a"
    real = fake(tmp_path / "real", "python3.12", 0.0010, version="3.12.4")
    fake(a, "python3", 0.0010, version="3.12.4", real=real)
    fake(a, "python3.12", 0.0010, version="3.12.4", real=real)
    fake(a, "python3.10", None)
    done = pick([a])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(real)
    assert done.stderr.count(f"{real} (3.12.4)") == 1


def test_the_real_interpreters_answer_the_probe():
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    chosen = Path(done.stdout.strip())
    version = subprocess.run([str(chosen), "-c", "import sys; print(sys.version_info[:2] >= (3, 10))"],
                             capture_output=True, text=True, check=True, timeout=60).stdout
    assert version.strip() == "True" and str(chosen) in done.stderr


def test_without_an_interpreter_that_can_make_a_venv_it_says_what_to_do(tmp_path):
    a = tmp_path / "a"
    fake(a, "python3", None)
    done = pick([a])
    assert done.returncode == 1 and done.stdout == ""
    assert "no Python 3.10-3.12 on PATH that can make a virtual environment" in done.stderr
    assert "make PYTHON=" in done.stderr
