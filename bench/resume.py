"""What resuming a killed run saves against starting it over, for a kill in each stage.

For each stage (validate, SFT, reward, policy, evaluate, register, deploy), a test-sized run
(the tests' tiny config; gates loose, auto-promotion and serving on; the reward model and the
policy trained long enough to be killed between checkpoints) is started with `rlhf run`,
SIGKILLed in that stage, and continued with `rlhf run --resume RUN_ID`. Starting over is an
uninterrupted run of the same config in a fresh store; `saved = scratch - resume`. Every run
uses the same Prefect server (one `prefect server start` for the benchmark), so Prefect's
start-up is not counted.

Short stages are killed from inside at their fault point (`rlhf_core.distributed.fault_injection.fault_point`: the
stage's work done, its MLflow run or journal entry not yet closed); the training stages once
Ray Train has committed a checkpoint, and the deploy in its health wait, from outside.

    .venv/bin/python bench/resume.py
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from bench.common import REPO, save, table  # noqa: E402
from rlhf_core.distributed.fault_injection import FAULT_ENV  # noqa: E402

STAGES = ("validate", "sft", "reward", "policy", "evaluate", "register", "deploy")
# where a run to be killed in a training stage waits for the kill (`fault_injection.fault_point`)
HOLDS = {"reward": "reward:checkpoint", "policy": "policy:checkpoint"}


def chaos_config(base: dict, ports: list[int]) -> dict:
    """`base` (the tests' tiny config) made killable: gates loose, auto-promotion and serving on;
    10 reward steps and 4 policy steps, with checkpoints every 4 and 2 steps. A run killed in a
    training stage is held at that stage's first checkpoint (`HOLDS`), so the kill lands
    mid-stage however fast the steps are."""
    raw = json.loads(json.dumps(base))
    raw["reward"].update(epochs=2, checkpoint_every=4)
    raw["policy"].update(steps=4, checkpoint_every=2, eval_every=4)
    raw["gates"] = {"auto_promote": True, "min_accuracy_gain": -1.0, "min_win_rate_vs_reference": 0.0,
                    "min_win_rate_vs_champion": 0.0, "max_regression_vs_champion": 1.0, "max_length_ratio": 100.0,
                    "max_degenerate_rate": 1.0, "max_kl": 1000.0}
    raw["serving"] = {"ports": ports, "smoke_prompt": "12+34="}
    return raw


def run_dir(runs: Path) -> Path | None:
    """The output directory of the one run under `runs` (the tiny config's name is `test`)."""
    found = sorted(p for p in runs.glob("test-*") if p.is_dir())
    return found[0] if found else None


def kill_points(runs: Path, state_dir: Path) -> dict[str, str | Callable[[], bool]]:
    """Per stage: the fault point to kill at (a string), or the condition to kill on from outside."""

    def committed(stage: str) -> Callable[[], bool]:
        def check() -> bool:  # Ray Train has committed a checkpoint of `stage`: its snapshot lists one
            out = run_dir(runs)
            snapshot = out / "ray" / stage / "checkpoint_manager_snapshot.json" if out else None
            return snapshot is not None and snapshot.exists() and "checkpoint_" in snapshot.read_text()
        return check

    return {"validate": "validate:end", "sft": "sft:end", "reward": committed("reward"), "policy": committed("policy"),
            "evaluate": "evaluate:end", "register": "register:returned",
            "deploy": lambda: (state_dir / "starting.json").exists()}  # its health wait


def launch(args: list[str], env: dict, log: Path, kill_at: str | None = None, hold_at: str | None = None
           ) -> subprocess.Popen:
    """`rlhf ARGS` in a process group of its own; with `kill_at`, it SIGKILLs itself there; with
    `hold_at`, it stops there and waits to be killed."""
    env = {k: v for k, v in env.items() if k not in ("RAY_ADDRESS", FAULT_ENV)}
    if kill_at or hold_at:
        env[FAULT_ENV] = f"kill:{kill_at}" if kill_at else f"hold:{hold_at}"
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def kill(proc: subprocess.Popen, how: str | Callable[[], bool], what: str, timeout: float = 900) -> None:
    """Wait for the run to die at its fault point (`how` a string), or SIGKILL its process group
    once `how()` holds; fail if it ends otherwise."""
    if isinstance(how, str):
        code = proc.wait(timeout)
        if code != -signal.SIGKILL:
            raise AssertionError(f"the run ended with {code}, not killed at {how}")
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if how():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(60)
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}")
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout} s")


def parent_run_id(tracking_uri: str) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    [run] = client.search_runs([client.get_experiment_by_name("tests").experiment_id], "tags.pipeline = 'rlhf-pipeline'")
    return run.info.run_id


def _one(stage: str | None, root: Path, env: dict) -> dict:
    """A fresh store and run directory; killed in `stage` and resumed (None: uninterrupted)."""
    from rlhf_core.testing.configs import tiny_config_dict
    from rlhf_core.testing.ports import free_ports

    from rlhf_core.serving import server

    root.mkdir(parents=True)
    raw = chaos_config(tiny_config_dict(root), free_ports(2))
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    runs, state_dir = root / "runs", root / "runs" / "serving"
    how = kill_points(runs, state_dir).get(stage)
    try:
        start = time.monotonic()
        proc = launch(["run", "--config", str(config)], env, root / "first.log",
                      kill_at=how if isinstance(how, str) else None, hold_at=HOLDS.get(stage))
        if stage is None:
            if proc.wait(1800) != 0:
                raise AssertionError((root / "first.log").read_text()[-3000:])
            return {"stage": "(none: from scratch)", "seconds": time.monotonic() - start}
        kill(proc, how, f"the {stage} stage's kill point")
        killed_after = time.monotonic() - start
        journal = sorted(p.stem for p in (run_dir(runs) / "stages").glob("*.pkl")) if run_dir(runs) else []
        start = time.monotonic()
        resumed = launch(["run", "--config", str(config), "--resume", parent_run_id(raw["tracking"]["tracking_uri"])],
                         env, root / "resume.log")
        if resumed.wait(1800) != 0:
            raise AssertionError((root / "resume.log").read_text()[-3000:])
        summary = json.loads((run_dir(runs) / "summary.json").read_text())
        return {"stage": stage, "killed_after_s": killed_after, "seconds": time.monotonic() - start,
                "reused": [s for s, v in summary["stages"].items() if v.get("reused")],
                "journal_at_kill": journal,
                "resumed_from_step": {s: summary["stages"][s].get("resumed_from_step") for s in ("reward", "policy")}}
    finally:
        server.stop(state_dir)


def main() -> None:
    from rlhf_core.testing.ports import free_ports

    stages = sys.argv[1:] or list(STAGES)
    server = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1",
                               "--port", str(port := free_ports(1)[0])], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    env = {**os.environ, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "CI": "1"}
    try:
        _wait_for_prefect(env["PREFECT_API_URL"])
        with tempfile.TemporaryDirectory() as tmp:
            scratch = _one(None, Path(tmp) / "scratch", env)
            rows = [scratch]
            for stage in stages:
                row = _one(stage, Path(tmp) / stage, env)
                row["saved_s"] = scratch["seconds"] - row["seconds"]
                row["saved_share"] = row["saved_s"] / scratch["seconds"]
                rows.append(row)
                print(f"{stage:9s} resume {row['seconds']:6.1f} s, saved {row['saved_s']:6.1f} s", flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    print(table(rows, ["stage", "killed_after_s", "seconds", "saved_s", "saved_share", "resumed_from_step"]))
    print("saved to", save("resume", {"scratch_s": scratch["seconds"], "rows": rows}))


def _wait_for_prefect(api: str, timeout: float = 120) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{api}/health", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"Prefect server at {api} did not come up in {timeout} s")


if __name__ == "__main__":
    main()
