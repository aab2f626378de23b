"""Orchestration overhead of the demo: the share of its wall time spent outside model compute.

Runs `rlhf demo` (unless `--analyse-only`), timing the whole command, then reads that run
back from MLflow. Model compute is what the stages spend in their training and evaluation
loops, from the metrics they log:

    sft       sft/seconds (the SFT loop and its held-out check)
    reward    the sum over optimizer steps of the step time of the worker that waited least
    policy    the sum over RL iterations of the step time of the worker that waited least
              (generation, scoring, logprobs, update, weight sync), plus eval/seconds of
              each evaluation
    gates     the evaluate stage's run (three policies answering the held-out prompts)

Why the least, not the slowest: a worker's step time runs from its start of the step to the
step's last collective. Rank 0 logs metrics, evaluates and checkpoints between steps while the
others have already started the next one and wait for it there, so their step times hold
rank 0's work between steps (evaluations would be counted twice). Data-parallel workers do
the same work in a step, so the least-waiting worker's time is the step's compute.

Everything else is overhead: Python and Prefect start-up (the temporary API server), MLflow
bookkeeping, data generation and validation, Ray cluster and worker start-up, DeepSpeed
initialisation, vLLM engine start, checkpointing, and starting the serving process.

    .venv/bin/python bench/orchestration_overhead.py
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlflow.tracking import MlflowClient  # noqa: E402

from bench.common import REPO, save, table  # noqa: E402


def _history_sum_of_min(client: MlflowClient, run_id: str, prefix: str) -> float:
    """Sum over steps of min over workers of `<prefix>/worker_<r>`."""
    keys = [k for k in client.get_run(run_id).data.metrics if k.startswith(prefix)]
    per_step: dict[int, float] = {}
    for key in keys:
        for m in client.get_metric_history(run_id, key):
            per_step[m.step] = min(per_step.get(m.step, math.inf), m.value)
    return sum(per_step.values())


def analyse(tracking_uri: str, wall_s: float | None) -> dict:
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("rlhf-pipeline")
    [parent] = client.search_runs([exp.experiment_id], "tags.pipeline = 'rlhf-pipeline' and tags.outcome = 'completed'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
    stages = {r.info.run_name: r for r in client.search_runs(
        [exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")}
    if "sft" not in stages:
        raise SystemExit(f"run {parent.info.run_id} reused a cached SFT policy: it is not what a fresh machine does")
    policy = stages["policy"].info.run_id
    compute = {
        "sft": stages["sft"].data.metrics["sft/seconds"],
        "reward": _history_sum_of_min(client, stages["reward"].info.run_id, "reward/step_time_s/worker_"),
        "policy_steps": _history_sum_of_min(client, policy, "policy/step_time_s/worker_"),
        "policy_evals": sum(m.value for m in client.get_metric_history(policy, "eval/seconds")),
        "gates": (stages["evaluate"].info.end_time - stages["evaluate"].info.start_time) / 1000,
    }
    run_s = (parent.info.end_time - parent.info.start_time) / 1000
    wall = wall_s if wall_s is not None else run_s
    model = sum(compute.values())
    # each stage's MLflow run, start to end: with compute_s, where the overhead sits
    stage_s = {name: (r.info.end_time - r.info.start_time) / 1000 for name, r in stages.items()}
    return {"pipeline_run": parent.info.run_id, "wall_s": wall, "mlflow_run_s": run_s, "compute_s": compute,
            "stage_wall_s": stage_s, "before_mlflow_run_s": wall - run_s if wall_s is not None else None,
            "model_compute_s": model, "overhead_s": wall - model, "overhead_share": (wall - model) / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--analyse-only", action="store_true", help="read the latest completed run, do not run")
    parser.add_argument("--tracking-uri", default=f"sqlite:///{REPO / 'mlflow.db'}")
    args = parser.parse_args()
    wall = None
    if not args.analyse_only:
        t0 = time.perf_counter()
        # PREFECT_TASKS_REFRESH_CACHE: compute every stage, as on a fresh machine (no cached SFT policy)
        subprocess.run([str(Path(sys.executable).parent / "rlhf"), "demo"], cwd=REPO, check=True,
                       env={**os.environ, "MLFLOW_TRACKING_URI": args.tracking_uri, "PREFECT_TASKS_REFRESH_CACHE": "true"})
        wall = time.perf_counter() - t0
    result = analyse(args.tracking_uri, wall)
    rows = [{"part": k, "seconds": v, "share": v / result["wall_s"]} for k, v in result["compute_s"].items()]
    rows += [{"part": "model compute", "seconds": result["model_compute_s"], "share": result["model_compute_s"] / result["wall_s"]},
             {"part": "overhead", "seconds": result["overhead_s"], "share": result["overhead_share"]},
             {"part": "wall (rlhf demo)" if wall else "wall (MLflow run)", "seconds": result["wall_s"], "share": 1.0}]
    print("\nDemo wall time, model compute and overhead:")
    print(table(rows, ["part", "seconds", "share"]))
    print("\nWall time of each stage's MLflow run:")
    print(table([{"stage": k, "seconds": v} for k, v in result["stage_wall_s"].items()], ["stage", "seconds"]))
    print(f"\nwritten {save('orchestration_overhead', result)}")


if __name__ == "__main__":
    main()
