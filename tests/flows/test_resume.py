"""A pipeline run killed (SIGKILL) in every stage, resumed each time with `rlhf run --resume`.

One run of the CLI, as a user starts it, on a test-sized config (gates loose, auto-promotion
and serving on), then killed in validate, SFT, reward, policy, evaluate, register and deploy in
turn; after each kill `rlhf run --resume RUN_ID` continues it. Short stages are killed from
inside at a fault point (`tasks.tracking.fault_point`: after the stage's work, before its
MLflow run or journal entry is closed); the training stages and the deploy from outside, once a
checkpoint or the deploy's intent file exists, as an operator's `kill -9` would.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml
from mlflow.tracking import MlflowClient

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]

REPO = Path(__file__).resolve().parents[2]
STAGES = ("validate", "sft", "reward", "policy", "evaluate")  # the stages with an MLflow run of their own


def _launch(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(proc: subprocess.Popen, condition, what: str, timeout: float = 600) -> None:
    """Poll `condition()` until it holds (then SIGKILL the process group), failing if the
    process ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(60)
            return
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {what}"
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout} s")


def test_a_run_killed_in_every_stage_resumes_to_one_registered_and_served_policy(
        tmp_path, tiny_config_factory, free_ports):
    from prefect.settings import PREFECT_API_URL

    from rlhf_core.serving import server

    raw = tiny_config_factory(tmp_path)
    # Steps take ~0.05 s (reward) and ~0.15 s (policy) here, and Ray Train commits a checkpoint
    # about a second after it is written: enough steps that the kill lands well before the end.
    raw["reward"].update(epochs=40, checkpoint_every=4)  # 200 steps
    raw["policy"].update(steps=60, checkpoint_every=2, eval_every=60)
    raw["gates"] = {"auto_promote": True, "min_accuracy_gain": -1.0, "min_win_rate_vs_reference": 0.0,
                    "min_win_rate_vs_champion": 0.0, "max_regression_vs_champion": 1.0, "max_length_ratio": 100.0,
                    "max_degenerate_rate": 1.0, "max_kl": 1000.0}
    raw["serving"] = {"ports": free_ports(2), "smoke_prompt": "12+34="}
    config = tmp_path / "chaos.yaml"
    config.write_text(yaml.safe_dump(raw))
    client = MlflowClient(raw["tracking"]["tracking_uri"])
    state_dir = tmp_path / "runs" / "serving"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RLHF_FAULT_KILL_AT")}
    env["PREFECT_API_URL"] = PREFECT_API_URL.value()

    def out_dir() -> Path | None:
        found = [p for p in (tmp_path / "runs").glob("test-*") if p.is_dir()]
        return found[0] if found else None

    def checkpoint_of(stage: str):
        """Ray Train has committed a checkpoint of `stage` (its snapshot lists one)."""
        def committed() -> bool:
            snapshot = out_dir() / "ray" / stage / "checkpoint_manager_snapshot.json" if out_dir() else None
            return snapshot is not None and snapshot.exists() and "checkpoint_" in snapshot.read_text()
        return committed

    kills = [  # (stage, fault point inside, or what to wait for before killing from outside)
        ("validate", "validate:end"), ("sft", "sft:end"),
        ("reward", checkpoint_of("reward")), ("policy", checkpoint_of("policy")),
        ("evaluate", "evaluate:end"), ("register", "register:returned"),
        ("deploy", lambda: (state_dir / "starting.json").exists()),  # its health wait
    ]
    run_id = None
    walls: list[tuple[str, float, list[str]]] = []
    try:
        for attempt, (stage, kill) in enumerate(kills):
            args = ["run", "--config", str(config)] + (["--resume", run_id] if run_id else [])
            start = time.monotonic()
            if isinstance(kill, str):
                proc = _launch(args, {**env, "RLHF_FAULT_KILL_AT": kill}, tmp_path / f"attempt{attempt}.log")
                assert proc.wait(900) == -signal.SIGKILL, (tmp_path / f"attempt{attempt}.log").read_text()[-3000:]
            else:
                proc = _launch(args, env, tmp_path / f"attempt{attempt}.log")
                _wait_for(proc, kill, f"the {stage} stage's kill point")
            walls.append((stage, time.monotonic() - start, sorted(p.stem for p in (out_dir() / "stages").glob("*.pkl"))))
            if run_id is None:
                [parent] = client.search_runs([client.get_experiment_by_name("tests").experiment_id],
                                              "tags.pipeline = 'rlhf-pipeline'")
                run_id = parent.info.run_id

        start = time.monotonic()
        final = _launch(["run", "--config", str(config), "--resume", run_id], env, tmp_path / "final.log")
        assert final.wait(900) == 0, (tmp_path / "final.log").read_text()[-4000:]
        walls.append(("(completes)", time.monotonic() - start, []))
        summary = json.loads((out_dir() / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["mlflow_run_id"] == run_id

        # no completed stage ran again: one FINISHED MLflow run per stage, one KILLED per kill in it
        exp = client.get_experiment_by_name("tests").experiment_id
        runs = client.search_runs([exp], f"tags.mlflow.parentRunId = '{run_id}'")
        by_stage = {s: sorted(r.info.status for r in runs if r.data.tags.get("stage") == s) for s in STAGES}
        assert by_stage == {s: ["FINISHED", "KILLED"] for s in STAGES}, by_stage
        assert not client.search_runs([exp], "attributes.status = 'RUNNING'")  # none left RUNNING
        parent = client.get_run(run_id)
        assert parent.info.status == "FINISHED" and parent.data.tags["resume.count"] == str(len(kills))
        assert all(summary["stages"][s].get("reused") for s in (*STAGES, "register")), summary["stages"]

        # the training stages continued from their checkpoints
        for stage, metric in (("reward", "reward/loss"), ("policy", "policy/reward_mean")):
            figures, every = summary["stages"][stage], raw[stage]["checkpoint_every"]
            resumed, steps = figures["resumed_from_step"], figures["steps"]
            assert every <= resumed < steps and resumed % every == 0, figures
            [done] = [r for r in runs if r.data.tags.get("stage") == stage and r.info.status == "FINISHED"]
            logged = sorted({m.step for m in client.get_metric_history(done.info.run_id, metric)})
            assert logged == list(range(resumed + 1, steps + 1)), (stage, logged)  # only the steps after it ran again

        # exactly one new policy version, the champion, and it serves
        versions = client.search_model_versions("name = 'policy'")
        assert [str(v.version) for v in versions] == ["1"]
        assert client.get_registered_model("policy").aliases == {"champion": 1}
        current = server.current_endpoint(state_dir)
        assert current.version == "1" and server.health(current.url)
        assert not (state_dir / "starting.json").exists()

        # what resuming saved: the seconds of completed stage work each rerun reused
        finished = {r.data.tags["stage"]: (r.info.end_time - r.info.start_time) / 1000
                    for r in runs if r.info.status == "FINISHED"}
        print("\nkilled in   wall s   journal at kill")
        for stage, wall, journal in walls:
            print(f"{stage:<11} {wall:6.1f}   {', '.join(journal)}")
        print("stage seconds (the run that completed):", {k: round(v, 1) for k, v in finished.items()})
    finally:
        server.stop(state_dir)
