"""How `rlhf` sets up the process before it runs a flow: no usage reporting, and Prefect's
temporary API server started early when no server is configured."""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable


def quiet_telemetry() -> None:
    """No usage reporting from Prefect, MLflow or Ray: runs are often offline, and a
    failed phone-home only adds errors to the logs. Explicit settings win."""
    for key, value in {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "RAY_USAGE_STATS_ENABLED": "0",
        "DO_NOT_TRACK": "1",
    }.items():
        os.environ.setdefault(key, value)


def start_prefect_server_early() -> Callable[[], None]:
    """Start Prefect's temporary API server now; return a function that waits for it to be up.

    With no `PREFECT_API_URL`, Prefect starts a temporary server (a uvicorn process) the
    first time a flow talks to its API. That comes after this process has imported the
    pipeline's libraries, and the server then takes seconds more while the other core idles.
    Started first, the server's start overlaps those imports (what that saves:
    docs/performance-notes.md, "Orchestration"). Prefect keeps one
    such server per process (`SubprocessASGIServer`), so the flow finds this one.

    The server's module is imported here, not on the thread (the flow would import it anyway):
    two threads importing one package's modules at once can deadlock on its import cycles.
    The thread only starts the process and polls its health. If that fails, nothing changes:
    the flow starts the server as it always did and reports any error itself.
    """
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        return lambda: None  # a real server, or none allowed: nothing to start
    import prefect.main  # noqa: F401 - sets up Prefect's logging, so the server's start is logged as before
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the one per-process instance the flow will find

    def start() -> None:
        try:
            server.start()
        except Exception:  # noqa: BLE001 - the flow retries the start and reports the error
            logging.getLogger(__name__).debug("early Prefect server start failed", exc_info=True)

    thread = threading.Thread(target=start, name="prefect-server-start", daemon=True)
    atexit.register(stop_when_started, server, thread)
    thread.start()
    return thread.join


def stop_when_started(server, thread: threading.Thread, wait_s: float = 10.0) -> None:
    """At exit, stop the server the thread is starting, even when the exit came first.

    Prefect registers its own stop only once the server's process is spawned. An exit in
    between (a SIGTERM while the flow's libraries import, on a busy machine) would otherwise
    leave the uvicorn process running with no parent. So wait, briefly, for the thread to
    get past the spawn or give up, then stop whatever it started; once stopped, a second
    stop does nothing.
    """
    deadline = time.monotonic() + wait_s
    while thread.is_alive() and server.server_process is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if server.server_process is not None:
        server.stop()
