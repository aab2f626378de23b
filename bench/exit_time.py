"""How long a finished process takes to end: the interpreter's usual teardown against
`flows.quick_exit` (exit handlers, then `os._exit`), in a process that imported the pipeline.

Each run starts a fresh interpreter that imports `flows.pipeline` (the model stack: torch,
transformers, vLLM, MLflow, Prefect), prints the time when its work is done and exits; the
figure is the wall time from that print to the process's end, as its parent sees it.

    .venv/bin/python bench/exit_time.py [--runs 5]     # bench/results/exit_time.json
"""
from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, save, table  # noqa: E402

PROGRAM = """
import sys, time
from flows import quick_exit
if {quick}:
    quick_exit.arm()
import flows.pipeline
print(time.time(), flush=True)
sys.exit(quick_exit.finish(0) if {quick} else 0)
"""


def one_exit(quick: bool) -> float:
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM.format(quick=quick)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    done_at = float(proc.stdout.readline())
    proc.wait()
    return time.time() - done_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for quick in (False, True):
        one_exit(quick)  # a warm-up: the libraries in the page cache
        seconds = [one_exit(quick) for _ in range(args.runs)]
        rows.append({"exit": "quick_exit" if quick else "usual teardown", "median_s": statistics.median(seconds),
                     "min_s": min(seconds), "max_s": max(seconds), "runs": len(seconds)})
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    ratio = rows[0]["median_s"] / rows[1]["median_s"]
    print(table(rows, ["exit", "median_s", "min_s", "max_s", "runs"]))
    print(f"usual / quick: {ratio:.1f}x; peak memory of one process {peak_mib:,.0f} MiB")
    print(save("exit_time", {"program": "import flows.pipeline, then exit", "rows": rows, "ratio": ratio,
                             "peak_process_rss_mib": round(peak_mib)}))


if __name__ == "__main__":
    main()
