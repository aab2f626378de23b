"""End a finished process without the interpreter's teardown.

After its exit handlers, CPython clears every module and runs full garbage collections to free
what refers to itself. A process that loaded the model stack (torch, transformers, vLLM,
MLflow, Prefect, pydantic's schemas) holds 700,000 objects or more, and those collections walk
all of them only for the process to end: seconds for a finished command (`bench/exit_time.py`;
docs/performance-notes.md, Orchestration).

`arm()`, called early in an entry point, registers an exit handler; `finish(code)` records the
process's exit code. A process that finished this way still exits through Python's exit as
usual: non-daemon threads are joined, and every exit handler registered after `arm()` runs
(Ray's, MLflow's and Prefect's shutdowns, `weakref` finalizers such as temporary directories'
clean-up, multiprocessing's children). Exit handlers run last-registered first, so `arm()`'s
runs after those; it then does what the handlers registered before it would have done
(logging's flush and close: the only one `flows.cli`'s imports register, which the tests
check), flushes stdout and stderr, and ends the process with `os._exit(code)`. A process that
did not call `finish` (an exception, a signal's SystemExit) gets the whole usual teardown.

What is skipped is the teardown alone: `__del__` of objects still alive at exit, which Python
does not promise to run, and the collections. A buffered file that nothing closed would lose
its buffer; the pipeline writes its files with context managers and its logs through logging.
Listed with the patches to other libraries' behaviour in `rlhf_core.patches`.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys

_armed = False
_code: int | None = None


def arm() -> None:
    """Register the ending handler; call it once, before the heavy imports (idempotent)."""
    global _armed
    if not _armed:
        _armed = True
        atexit.register(_end)


def finish(code: int) -> int:
    """Record that the process finished with `code` (returned, for `sys.exit(finish(main()))`)."""
    global _code
    _code = code
    return code


def _end() -> None:
    if _code is None:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more to write anyway
            pass
    os._exit(_code)
