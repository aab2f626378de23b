"""`make gpu-check` (bench/gpu_check.py) on a machine without a GPU: a dry run that passes,
says so, names what it would run on a GPU, and imports nothing a GPU machine lacks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What a GPU machine does not have; `sitecustomize` runs at the start of every Python process
# whose path holds it, so the blocks hold in the script and in the pytest it starts alike.
ABSENT_ON_GPU_MACHINES = ("ray", "deepspeed", "vllm", "prefect", "mlflow")
BLOCKER = "import sys\nfor name in {names!r}:\n    sys.modules[name] = None  # `import name` raises ImportError\n"


@pytest.mark.slow  # a pytest inside a subprocess, and a GRPO step at a 0.5B model's shape: not in `make test-fast`
def test_the_dry_run_passes_on_the_cpu_without_the_engines_and_names_the_gpu_shape(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER.format(names=ABSENT_ON_GPU_MACHINES))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "CUDA_VISIBLE_DEVICES": ""}
    blocked = subprocess.run([sys.executable, "-c", "import vllm"], env=env, capture_output=True, text=True)
    assert blocked.returncode != 0 and "import of vllm halted" in blocked.stderr, blocked.stderr

    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(out)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "DRY RUN" in run.stdout and "dry run (CPU figures) passed" in run.stdout
    assert "not a GPU one" in run.stdout and "peak GPU memory" not in run.stdout
    assert ("Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 32000"
            in run.stdout)
    assert "needs a CUDA device" in run.stdout  # the device tests ran, their CUDA cases skipped

    result = json.loads(out.read_text())
    assert result["dry_run"] is True and result["device"] == "cpu" and result["peak_gpu_memory_gib"] is None
    assert result["failed"] == [] and result["tests"]["returncode"] == 0 and " passed" in result["tests"]["summary"]
    [step] = result["grpo"]["steps"]
    assert step["failed_checks"] == [] and step["generated_tokens"] > 0
    assert set(step["seconds"]) >= {"generate", "logprobs", "update", "total"}
