"""A pipeline run killed (SIGKILL) in every stage, resumed each time with `rlhf run --resume`.

One run of the CLI, as a user starts it, on a test-sized config (gates loose, auto-promotion
and serving on), then killed in validate, SFT, reward, policy, evaluate, register and deploy in
turn; after each kill `rlhf run --resume RUN_ID` continues it. Short stages are killed from
inside at a fault point (`rlhf_core.distributed.fault_injection.fault_point`: after the stage's work, before its
MLflow run or journal entry is closed); the training stages and the deploy from outside, once a
checkpoint or the deploy's intent file exists, as an operator's `kill -9` would (a training
stage waits at its first committed checkpoint for it: a `hold` there).
"""
from __future__ import annotations

import json
import os
import time

import pytest
import yaml
from mlflow.tracking import MlflowClient

# eight runs of the CLI, each starting its own Ray cluster: the longest test of the suite (~6 min)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), pytest.mark.usefixtures("prefect_server")]

STAGES = ("validate", "sft", "reward", "policy", "evaluate")  # the stages with an MLflow run of their own


def test_a_run_killed_in_every_stage_resumes_to_one_registered_and_served_policy(
        tmp_path, tiny_config_factory, free_ports):
    from prefect.settings import PREFECT_API_URL

    from bench.resume import HOLDS, STAGES as KILLED_IN, chaos_config, kill, kill_points, launch, parent_run_id, run_dir
    from rlhf_core.serving import server

    raw = chaos_config(tiny_config_factory(tmp_path), free_ports(2))
    config = tmp_path / "chaos.yaml"
    config.write_text(yaml.safe_dump(raw))
    client = MlflowClient(raw["tracking"]["tracking_uri"])
    runs, state_dir = tmp_path / "runs", tmp_path / "runs" / "serving"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    kills = kill_points(runs, state_dir)
    run_id = None
    walls: list[tuple[str, float, list[str]]] = []
    try:
        for attempt, stage in enumerate(KILLED_IN):
            args = ["run", "--config", str(config)] + (["--resume", run_id] if run_id else [])
            start = time.monotonic()
            how = kills[stage]
            proc = launch(args, env, tmp_path / f"attempt{attempt}.log", kill_at=how if isinstance(how, str) else None,
                          hold_at=HOLDS.get(stage))
            kill(proc, how, f"the {stage} stage's kill point")
            walls.append((stage, time.monotonic() - start, sorted(p.stem for p in (run_dir(runs) / "stages").glob("*.pkl"))))
            run_id = run_id or parent_run_id(raw["tracking"]["tracking_uri"])

        start = time.monotonic()
        final = launch(["run", "--config", str(config), "--resume", run_id], env, tmp_path / "final.log")
        assert final.wait(900) == 0, (tmp_path / "final.log").read_text()[-4000:]
        walls.append(("(completes)", time.monotonic() - start, []))
        summary = json.loads((run_dir(runs) / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["mlflow_run_id"] == run_id

        # a Ray cluster started only by an attempt that trained or ran the gates (SFT is Ray work too;
        # the one killed in evaluate first finishes the policy stage killed before it, the one killed
        # in register first redoes the gates killed before it), none once the gates were journalled
        logs = {stage: tmp_path / f"attempt{i}.log" for i, stage in enumerate(KILLED_IN)}
        logs["(completes)"] = tmp_path / "final.log"
        started = {stage: "Started a local Ray instance" in log.read_text() for stage, log in logs.items()}
        assert started == {stage: stage in ("sft", "reward", "policy", "evaluate", "register") for stage in logs}, started

        # no completed stage ran again: one FINISHED MLflow run per stage, one KILLED per kill in it
        exp = client.get_experiment_by_name("tests").experiment_id
        stage_runs = client.search_runs([exp], f"tags.mlflow.parentRunId = '{run_id}'")
        by_stage = {s: sorted(r.info.status for r in stage_runs if r.data.tags.get("stage") == s) for s in STAGES}
        assert by_stage == {s: ["FINISHED", "KILLED"] for s in STAGES}, by_stage
        assert not client.search_runs([exp], "attributes.status = 'RUNNING'")  # none left RUNNING
        parent = client.get_run(run_id)
        assert parent.info.status == "FINISHED" and parent.data.tags["resume.count"] == str(len(KILLED_IN))
        assert all(summary["stages"][s].get("reused") for s in (*STAGES, "register")), summary["stages"]

        # the training stages continued from their checkpoints
        for stage, metric in (("reward", "reward/loss"), ("policy", "policy/reward_mean")):
            figures, every = summary["stages"][stage], raw[stage]["checkpoint_every"]
            resumed, steps = figures["resumed_from_step"], figures["steps"]
            assert every <= resumed < steps and resumed % every == 0, figures
            [done] = [r for r in stage_runs if r.data.tags.get("stage") == stage and r.info.status == "FINISHED"]
            logged = sorted({m.step for m in client.get_metric_history(done.info.run_id, metric)})
            assert logged == list(range(resumed + 1, steps + 1)), (stage, logged)  # only the steps after it ran again

        # exactly one new policy version, the champion, and it serves
        versions = client.search_model_versions("name = 'policy'")
        assert [str(v.version) for v in versions] == ["1"]
        assert client.get_registered_model("policy").aliases == {"champion": 1}
        current = server.current_endpoint(state_dir)
        assert current.version == "1" and server.health(current.url)
        assert not (state_dir / "starting.json").exists()

        print("\nkilled in   wall s   journal at kill")  # the seconds saved: bench/resume.py
        for stage, wall, journal in walls:
            print(f"{stage:<11} {wall:6.1f}   {', '.join(journal)}")
    finally:
        server.stop(state_dir)
