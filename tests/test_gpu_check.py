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
    # one core of the machine: the dry run's processes (a pytest, the worker loops, the stand-in engine) check
    # code paths, not speed, and leave the suite's other worker its core
    one_core = min(os.sched_getaffinity(0))
    run = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(out)], cwd=REPO, env=env,
                         preexec_fn=lambda: os.sched_setaffinity(0, {one_core}),
                         capture_output=True, text=True, timeout=600)
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
    assert "the worker loops are left out: they train under DeepSpeed, which is not installed here" in run.stdout
    assert "every check held" in run.stdout

    assert result["dry_run"] is True and result["device"] == "cpu" and result["peak_gpu_memory_gib"] is None
    assert result["failed"] == [] and result["tests"]["returncode"] == 0 and " passed" in result["tests"]["summary"]
    [step] = result["grpo"]["steps"]
    assert step["failed_checks"] == [] and step["generated_tokens"] > 0
    assert set(step["seconds"]) >= {"generate", "logprobs", "update", "total"}
    assert result["grpo_deepspeed"] is None
    # every phase wrote the JSON as it ended; the gates ran through the gate stage's own function, in fp32 on the CPU
    assert result["phases_done"] == ["device tests", "GRPO", "GRPO under DeepSpeed", "worker loops left out",
                                     "memory hand-off", "gates"]
    # the hand-off's turns at the one-GPU plan's part sizes (docs/gpu.md (a)), at 1/1024 and unmeasured on the CPU
    handoff = result["handoff"]
    assert handoff["failed_checks"] == [] and handoff["checks"] == {"the engine woke after the update": True}
    assert round(handoff["parts_gib"]["engine"], 1) == 14.2 and round(handoff["preflight_rank0_gib"], 1) == 27.3
    assert handoff["sleeps"] and set(handoff["in_use_gib"].values()) == {None}
    gates = result["gates"]
    assert gates["failed_checks"] == [] and gates["dtype"] == "torch.float32" and gates["peak_gpu_memory_gib"] is None
    assert gates["serving_dtype"] == "float32" and len(gates["engine_start_s"]) == 2  # one engine a policy
    assert gates["metrics"]["eval/num_prompts"] == 16 and gates["metrics"]["eval/reference/win_rate_vs_reference"] == 0.5


@pytest.mark.slow
def test_where_deepspeed_is_installed_the_same_step_and_the_stages_worker_loops_run_without_ray(tmp_path):
    run, result = dry_run(tmp_path, ("vllm", "ray", "prefect", "mlflow"))
    runs = "reward, grpo, ppo, grpo-zero3, grpo-lora, dpo, dpo-lora, dpo-zero3, grpo-unsynced"
    assert f"plain torch and under DeepSpeed; the worker loops of {runs}; the gates in" in run.stdout
    assert result["phases_done"] == ["device tests", "GRPO", "GRPO under DeepSpeed", "reward loop", "grpo loop",
                                     "one-step loops", "unsynced loop", "memory hand-off", "gates"]
    torch_run, ds_run = result["grpo"], result["grpo_deepspeed"]
    assert ds_run["trainer"].startswith("DeepSpeed ") and "ZeRO-" in ds_run["trainer"]
    [plain], [ds] = torch_run["steps"], ds_run["steps"]
    assert ds["failed_checks"] == [] and result["failed"] == []
    # one seed, one batch, fp32 weights on the CPU either way: the engine changes who steps, not the step
    for key in ("pg_loss", "grad_norm", "kl_loss", "entropy"):
        assert ds["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-4, abs=1e-6), key

    # The stages' own worker loops, Ray and vLLM unimportable, in a world of one. The reward stage, then GRPO
    # rewarded by it, were each killed after step 2 (SIGKILL, before step 2's checkpoint) and run again: each
    # resumed from step 1 and redid step 2 exactly (fp32 on the CPU: the same data, weights, RNG and samples).
    loops = result["loops"]
    for name, steps in (("reward", [1, 2, 2, 3, 4]), ("grpo", [1, 2, 2, 3, 4])):
        killed_and_resumed = loops[name]
        assert all(killed_and_resumed["checks"].values()), (name, killed_and_resumed["checks"])
        assert killed_and_resumed["killed"]["returncode"] == -9 and killed_and_resumed["killed"]["results"] == {}
        assert [step for step, _ in killed_and_resumed["step_losses"]] == steps, name
        redone = [loss for step, loss in killed_and_resumed["step_losses"] if step == 2]
        assert redone[0] == redone[1], name
    reward = loops["reward"]["resumed"]["results"]["reward"]
    assert reward["proxy"]["steps"] == 4 and (reward["proxy"]["attempts"], reward["proxy"]["resumed_from_step"]) == (2, 1)
    assert reward["audit"]["steps"] == 1 and reward["audit"]["attempts"] == 1
    grpo = loops["grpo"]["resumed"]["results"]["grpo"]
    assert grpo["policy"]["steps"] == 4 and grpo["policy"]["audit_score_after"] is not None  # the audit model scored
    for name in ("grpo", "ppo", "grpo-zero3", "grpo-lora"):
        figures = loops["grpo"]["resumed"]["results"]["grpo"] if name == "grpo" else loops[name]
        synced = [m for m in figures["steps_logged"] if "rollout/sync_s" in m]
        # the stand-in engine in its second process took every update and the stage checked it: the engine's
        # log-probs of the step's tokens are the trainer's (fp32 on both sides here)
        assert synced and all(m["rollout/prob_diff"] < 1e-6 and m["rollout/verify_gap"] < 1e-6 for m in synced), name
        # it slept during every update and woke for every sync, as a colocated engine on a GPU does
        assert all("rollout/wake_s" in m and "rollout/sleep_s" in m for m in synced), name
        assert figures["policy"]["steps"] >= 1, name
    assert any("policy/value_loss" in m for m in loops["ppo"]["steps_logged"])  # the critic trained
    # a sync that never reached the engine (asleep through the update, as on a GPU) stops the stage at its check
    unsynced = loops["grpo-unsynced"]
    assert unsynced["caught"] and unsynced["returncode"] == 1
    assert unsynced["said"] == ["check:     the engine still sleeps after the sync: no weights woke it"]
    for name in ("dpo", "dpo-lora", "dpo-zero3"):
        policy = loops[name]["policy"]
        assert policy["steps"] == 2 and policy["attempts"] == 1, name
        assert 0 <= policy["held_out"]["eval/reward_accuracy"] <= 1 and policy["kl"] >= 0, name
