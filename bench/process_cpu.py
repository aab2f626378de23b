"""Where a command's CPU time goes, by kind of process: vLLM workers, Ray Train workers and
Ray's own actors, pipeline CLI runs, servers, the test processes.

    .venv/bin/python bench/process_cpu.py --label suite -- .venv/bin/python -m pytest -n 2 --dist loadfile

Every 0.5 s it reads the CPU time of every process on the machine (/proc), keyed by pid and
start time so that a reused pid is a new process; a process's CPU is its last reading less
what it had used when sampling began. A process that lives less than half a second between
two readings can be missed. The machine is sampled, not the command's process tree: servers
started detached (vLLM, MLflow) are counted, and so is anything else that runs meanwhile, so
measure on an otherwise idle machine. The sampler itself is a row of the table (about 1% of a
core). Prints the table and writes bench/results/process_cpu[_LABEL].json.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import save, table  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
# (substring of the command line, kind): the first that matches names the process
KINDS = (
    ("process_cpu.py", "this sampler"),
    ("vllm.entrypoints.openai.api_server", "vLLM server: API process"),
    ("gcs_server", "Ray: node processes"), ("raylet", "Ray: node processes"), ("ray/dashboard", "Ray: node processes"),
    ("log_monitor.py", "Ray: node processes"), ("autoscaler/_private/monitor.py", "Ray: node processes"),
    ("default_worker.py", "Ray: worker not yet named"),
    ("huey_consumer", "MLflow server: job consumers"), ("mlflow server", "MLflow server"),
    ("mlflow/server", "MLflow server"), ("prefect.server", "Prefect server"), ("prefect worker", "Prefect worker"),
    ("moto_server", "S3 (moto)"), ("flows.cli run", "rlhf run (CLI)"), ("bin/rlhf run", "rlhf run (CLI)"),
    ("flows.cli", "rlhf, other commands"), ("bin/rlhf", "rlhf, other commands"), ("cc1plus", "C/C++ compiler"),
    ("cc1 ", "C/C++ compiler"), ("xdist", "pytest worker"), ("pytest", "pytest"), ("prometheus", "Prometheus"),
)
# Ray's actors and vLLM's processes rename themselves (`ray::TrainController`, `VLLM::Worker`)
RAY_HELPERS = {"TrainController", "PlacementGroupCleaner", "DatasetManager", "SynchronizationActor",
               "_AutoscalingCoordinatorActor", "DashboardAgent", "RuntimeEnvAgent", "IDLE"}


def kind(cmdline: str, comm: str) -> str:
    """The kind of a process from its command line (argv joined by spaces) and its name."""
    head = cmdline.split(" ", 1)[0]
    for name in (head, comm):
        if name.startswith("ray::"):
            actor = name.removeprefix("ray::").split(".", 1)[0]
            if actor in RAY_HELPERS:
                return f"Ray: {actor}"
            return "Ray Train: worker" if actor == "RayTrainWorker" else f"Ray: actor {actor}"
        if name.startswith("VLLM::"):
            return f"vLLM: {name.removeprefix('VLLM::')}"
    for needle, name in KINDS:
        if needle in cmdline:
            return name
    if comm.startswith("postgres"):
        return "PostgreSQL"
    return "other Python" if "python" in head else f"other: {comm}"


def read_processes() -> dict[tuple[int, int], tuple[int, str, str]]:
    """{(pid, start time): (CPU ticks used, command line, name)} of every process readable now."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[(int(pid), int(fields[19]))] = (int(fields[11]) + int(fields[12]), cmdline, comm)
    return out


def sample_while(proc: subprocess.Popen, every_s: float = 0.5) -> tuple[dict, dict]:
    """Readings until `proc` ends: (what each process had used at the start, the last reading
    of every process seen). A process keeps the name of its last reading (actors rename)."""
    start = {key: ticks for key, (ticks, _, _) in read_processes().items()}
    seen: dict = {}
    while True:
        done = proc.poll() is not None
        for key, (ticks, cmdline, comm) in read_processes().items():
            old = seen.get(key)
            seen[key] = (max(ticks, old[0] if old else 0), cmdline or (old[1] if old else ""), comm)
        if done:
            return start, seen
        time.sleep(every_s)


def by_kind(start: dict, seen: dict) -> list[dict]:
    """CPU seconds per kind of process, the most first."""
    cpu: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for key, (ticks, cmdline, comm) in seen.items():
        used = (ticks - start.get(key, 0)) / TICKS
        if used > 0:
            name = kind(cmdline, comm)
            cpu[name] += used
            count[name] += 1
    total = sum(cpu.values()) or 1.0
    return [{"kind": name, "processes": count[name], "cpu_s": round(seconds, 1),
             "share": round(seconds / total, 3), "cpu_s_each": round(seconds / count[name], 2)}
            for name, seconds in sorted(cpu.items(), key=lambda item: -item[1])]


def top_processes(start: dict, seen: dict, n: int = 40) -> list[dict]:
    """The `n` processes that used the most CPU: kind, seconds and the head of the command line
    (what the table's "other" rows are made of)."""
    used = [((ticks - start.get(key, 0)) / TICKS, kind(cmdline, comm), cmdline[:160] or comm)
            for key, (ticks, cmdline, comm) in seen.items()]
    return [{"cpu_s": round(seconds, 1), "kind": name, "command": command}
            for seconds, name, command in sorted(used, reverse=True)[:n] if seconds > 0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="", help="results file: process_cpu_LABEL.json")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    began = time.monotonic()
    proc = subprocess.Popen(command)
    start, seen = sample_while(proc)
    wall = time.monotonic() - began
    rows = by_kind(start, seen)
    total = sum(r["cpu_s"] for r in rows)
    cores = len(os.sched_getaffinity(0))
    print(table(rows, ["kind", "processes", "cpu_s", "share", "cpu_s_each"]))
    print(f"\n{total:,.0f} CPU-s in {wall:,.0f} s of wall time on {cores} cores: "
          f"{total / (wall * cores):.0%} busy; the command exited {proc.returncode}")
    save("process_cpu" + (f"_{args.label}" if args.label else ""),
         {"command": command, "exit_code": proc.returncode, "wall_s": round(wall, 1), "cpu_s": round(total, 1),
          "cores": cores, "kinds": rows, "top_processes": top_processes(start, seen)})
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
