"""What Ray Train's helper actors cost a fit: the dataset manager and the placement-group cleaner
it starts in every fit, and the autoscaling coordinator it starts on a cluster's first fit,
against `cluster.StageTrainer`, which on a cluster this process started leaves all three out
(the dataset manager where no Ray Dataset is passed).

Each fit runs a two-worker training function that reports once (the fixed start-up and end of
a stage, nothing else) on a local cluster started as the pipeline starts its own
(`LOCAL_CLUSTER_ENV`). Part one runs every variant on one cluster, after a warm-up fit that
made its coordinator; part two starts a fresh cluster for each fit, the first fit on a cluster
being the one that makes the coordinator. The variants take turns, their order rotated each
round; a fit's figures are its wall time and the whole machine's busy CPU seconds (/proc/stat)
from its start to 3 s after it returned, once its actors have exited. Run it on an otherwise
idle machine.

    .venv/bin/python bench/fit_helpers.py [--rounds 3]     # bench/results/fit_helpers.json
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import save, table  # noqa: E402

SETTLE_S = 3.0  # after fit() returns: the helper actors' processes exit


def busy_cpu_s() -> float:
    """Busy CPU seconds of the whole machine since boot (all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def report_once() -> None:
    from ray import train

    train.report({"step": 1})


OURS = "StageTrainer (none of them)"


def variants() -> tuple[dict[str, type], dict[str, type]]:
    """(the variants of part one, of part two), by name."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from rlhf_core.distributed.cluster import StageTrainer

    class WithCleaner(StageTrainer):
        """StageTrainer with Ray Train's placement-group cleaner."""

        def _create_default_callbacks(self) -> list:
            return [c for c in TorchTrainer._create_default_callbacks(self) if not isinstance(c, DatasetsCallback)]

    class WithCoordinator(StageTrainer):
        """StageTrainer with Ray Train's scaling policy, which asks the autoscaling coordinator."""

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            return DataParallelTrainer._initialize_and_run_controller(self, **controller_init_kwargs)

    return ({"Ray Train's defaults (TorchTrainer)": TorchTrainer, "the cleaner": WithCleaner, OURS: StageTrainer},
            {"the coordinator": WithCoordinator, OURS: StageTrainer})


def helper_actors() -> dict[str, str]:
    import ray

    return {a: info["ActorClassName"] for a, info in ray._private.state.actors().items()  # noqa: SLF001
            if info["ActorClassName"] in ("DatasetManager", "PlacementGroupCleaner", "_AutoscalingCoordinatorActor")}


def one_fit(trainer_cls: type, storage: str, name: str) -> dict:
    from ray.train import RunConfig, ScalingConfig

    before = helper_actors()
    trainer = trainer_cls(report_once, scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name=name, storage_path=storage))
    cpu0, wall0 = busy_cpu_s(), time.monotonic()
    trainer.fit()
    wall = time.monotonic() - wall0
    time.sleep(SETTLE_S)
    started = sorted(cls for actor, cls in helper_actors().items() if actor not in before)
    return {"wall_s": wall, "cpu_s": busy_cpu_s() - cpu0, "helpers": started}


def rounds(kinds: dict[str, type], n: int, storage: str, fresh_cluster: bool) -> dict[str, list[dict]]:
    """`n` fits of each variant, in turns (on a fresh cluster each where `fresh_cluster`)."""
    from rlhf_core.distributed.cluster import shutdown_ray, start_local_ray

    fits: dict[str, list[dict]] = {name: [] for name in kinds}
    names = list(kinds)
    for r in range(n):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if fresh_cluster:
                start_local_ray(num_cpus=2, log_to_driver=False)
            try:
                fits[name].append(one_fit(kinds[name], storage, f"r{r}-{len(fits[name])}-{kinds[name].__name__}"))
            finally:
                if fresh_cluster:
                    shutdown_ray()
            print(f"round {r + 1}{' (fresh cluster)' if fresh_cluster else ''}: {name}: "
                  f"{fits[name][-1]['wall_s']:.1f} s, {fits[name][-1]['cpu_s']:.1f} CPU-s", flush=True)
    return fits


def summary(fits: dict[str, list[dict]]) -> list[dict]:
    return [{"helpers started": ", ".join(runs[0]["helpers"]) or "none", "trainer": name,
             "wall_s": statistics.median(r["wall_s"] for r in runs), "wall_range": _range(runs, "wall_s"),
             "cpu_s": statistics.median(r["cpu_s"] for r in runs), "cpu_range": _range(runs, "cpu_s")}
            for name, runs in fits.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from rlhf_core.distributed.cluster import LOCAL_CLUSTER_ENV, shutdown_ray, start_local_ray

    os.environ.update({k: os.environ.get(k, v) for k, v in LOCAL_CLUSTER_ENV.items()})
    one_cluster, fresh = variants()
    with tempfile.TemporaryDirectory(prefix="fit-helpers-") as storage:  # the fits' checkpoints and records
        start_local_ray(num_cpus=2, log_to_driver=False)
        try:
            one_fit(one_cluster["Ray Train's defaults (TorchTrainer)"], storage, "warm-up")  # makes the coordinator
            per_fit = summary(rounds(one_cluster, args.rounds, storage, fresh_cluster=False))
        finally:
            shutdown_ray()
        first_fit = summary(rounds(fresh, args.rounds, storage, fresh_cluster=True))
    columns = ["trainer", "helpers started", "wall_s", "wall_range", "cpu_s", "cpu_range"]
    print("Every fit (one cluster):")
    print(table(per_fit, columns))
    print("The first fit on a fresh cluster:")
    print(table(first_fit, columns))
    ours, theirs, cleaner = per_fit[2], per_fit[0], per_fit[1]
    print(f"a fit: StageTrainer {theirs['wall_s'] - ours['wall_s']:.1f} s and {theirs['cpu_s'] - ours['cpu_s']:.1f} "
          f"CPU-s less than Ray Train's defaults, of which the cleaner {cleaner['wall_s'] - ours['wall_s']:.1f} s and "
          f"{cleaner['cpu_s'] - ours['cpu_s']:.1f} CPU-s; a cluster's first fit: the coordinator "
          f"{first_fit[0]['wall_s'] - first_fit[1]['wall_s']:.1f} s and {first_fit[0]['cpu_s'] - first_fit[1]['cpu_s']:.1f} CPU-s")
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(save("fit_helpers", {"rounds": args.rounds, "workers": 2, "settle_s": SETTLE_S, "every_fit": per_fit,
                               "first_fit_on_a_fresh_cluster": first_fit, "driver_peak_rss_mib": round(peak_mib)}))


def _range(runs: list[dict], key: str) -> str:
    return f"{min(r[key] for r in runs):.1f}-{max(r[key] for r in runs):.1f}"


if __name__ == "__main__":
    main()
