"""A finished `rlhf` process ends without the interpreter's teardown, and owes nothing for it:
exit handlers, threads, output, logs and temporary directories are done as in a usual exit."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import atexit, logging, sys, tempfile, threading, time
from pathlib import Path
from flows import quick_exit

out = Path(sys.argv[1])
quick_exit.arm()
logging.basicConfig(filename=out / "run.log", level=logging.INFO)  # flushed by logging's exit handler
atexit.register(lambda: (out / "handler").write_text("ran"))       # registered after arm(): runs first
kept = tempfile.TemporaryDirectory(dir=out)                         # removed by its weakref finalizer
(out / "tmpdir").write_text(kept.name)

def late_writer():
    time.sleep(0.5)
    (out / "thread").write_text("joined")
threading.Thread(target=late_writer).start()                        # non-daemon: the exit waits for it

class Witness:
    def __del__(self):
        (out / "teardown").write_text("ran")
Witness.kept = Witness()                                            # alive at exit: only a teardown frees it

logging.getLogger("run").info("the last line of the log")
sys.stdout.write("no newline, still buffered")
{end}
"""


def run(tmp_path: Path, end: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(end=end)))
    return subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_a_finished_process_keeps_its_exit_code_and_owes_nothing_but_skips_the_teardown(tmp_path):
    done = run(tmp_path, "sys.exit(quick_exit.finish(3))")
    assert done.returncode == 3, done.stderr
    assert done.stdout == "no newline, still buffered"
    assert (tmp_path / "run.log").read_text().strip().endswith("the last line of the log")
    assert (tmp_path / "handler").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "joined"
    assert not Path((tmp_path / "tmpdir").read_text()).exists()
    assert not (tmp_path / "teardown").exists()  # the interpreter's teardown did not run
    assert done.stderr == ""


def test_a_process_that_did_not_finish_gets_the_usual_exit(tmp_path):
    done = run(tmp_path, "raise RuntimeError('broken')")
    assert done.returncode == 1 and "RuntimeError: broken" in done.stderr
    assert (tmp_path / "teardown").read_text() == "ran"  # the usual teardown
    assert (tmp_path / "handler").read_text() == "ran" and (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "run.log").read_text().strip().endswith("the last line of the log")


def test_the_commands_imports_register_no_exit_handler_but_loggings():
    """`quick_exit.arm()` runs after flows.cli is imported, so only handlers registered later run
    before it ends the process; one registered by an import of flows.cli would be skipped."""
    probe = ("import atexit\n"
             "seen = []\n"
             "register = atexit.register\n"
             "atexit.register = lambda f, *a, **k: seen.append(f'{f.__module__}.{f.__qualname__}') or register(f, *a, **k)\n"
             "import flows.cli\n"
             "print(seen)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60,
                          check=True)
    assert done.stdout.strip() == "['logging.shutdown']"
