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


def dry_run(tmp_path, absent: tuple[str, ...]) -> tuple[subprocess.CompletedProcess, dict]:
    """`bench/gpu_check.py --dry-run` with the modules `absent` made unimportable -> (the run, its result)."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER.format(names=absent))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "CUDA_VISIBLE_DEVICES": ""}
    blocked = subprocess.run([sys.executable, "-c", f"import {absent[0]}"], env=env, capture_output=True, text=True)
    assert blocked.returncode != 0 and f"import of {absent[0]} halted" in blocked.stderr, blocked.stderr
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(out)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run, json.loads(out.read_text())


@pytest.mark.slow  # a pytest inside a subprocess, and a GRPO step at a 0.5B model's shape: not in `make test-fast`
def test_the_dry_run_passes_on_the_cpu_without_the_engines_and_names_the_gpu_shape(tmp_path):
    run, result = dry_run(tmp_path, ("vllm", *(m for m in ABSENT_ON_GPU_MACHINES if m != "vllm")))
    assert "DRY RUN" in run.stdout and "dry run (CPU figures) passed" in run.stdout
    assert "not a GPU one" in run.stdout and "peak GPU memory" not in run.stdout
    assert ("Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 32000"
            in run.stdout)
    assert "needs a CUDA device" in run.stdout  # the device tests ran, their CUDA cases skipped
    assert "DeepSpeed is not installed here" in run.stdout and "(DeepSpeed not installed); the gates in" in run.stdout
    assert "every check held" in run.stdout

    assert result["dry_run"] is True and result["device"] == "cpu" and result["peak_gpu_memory_gib"] is None
    assert result["failed"] == [] and result["tests"]["returncode"] == 0 and " passed" in result["tests"]["summary"]
    [step] = result["grpo"]["steps"]
    assert step["failed_checks"] == [] and step["generated_tokens"] > 0
    assert set(step["seconds"]) >= {"generate", "logprobs", "update", "total"}
    assert result["grpo_deepspeed"] is None
    # every phase wrote the JSON as it ended; the gates ran through the gate stage's own function, in fp32 on the CPU
    assert result["phases_done"] == ["device tests", "GRPO", "GRPO under DeepSpeed", "gates"]
    gates = result["gates"]
    assert gates["failed_checks"] == [] and gates["dtype"] == "torch.float32" and gates["peak_gpu_memory_gib"] is None
    assert gates["metrics"]["eval/num_prompts"] == 16 and gates["metrics"]["eval/reference/win_rate_vs_reference"] == 0.5


@pytest.mark.slow
def test_where_deepspeed_is_installed_the_same_step_runs_under_the_policy_stages_engine_with_the_same_result(tmp_path):
    run, result = dry_run(tmp_path, ("vllm", "ray", "prefect", "mlflow"))
    assert "plain torch and under DeepSpeed; the gates in" in run.stdout
    torch_run, ds_run = result["grpo"], result["grpo_deepspeed"]
    assert ds_run["trainer"].startswith("DeepSpeed ") and "ZeRO-" in ds_run["trainer"]
    [plain], [ds] = torch_run["steps"], ds_run["steps"]
    assert ds["failed_checks"] == [] and result["failed"] == []
    # one seed, one batch, fp32 weights on the CPU either way: the engine changes who steps, not the step
    for key in ("pg_loss", "grad_norm", "kl_loss", "entropy"):
        assert ds["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-4, abs=1e-6), key
