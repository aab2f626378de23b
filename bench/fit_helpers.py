"""What Ray Train's helper actors cost a fit: the dataset manager and the placement-group cleaner
that Ray Train starts in every fit, against `cluster.StageTrainer`, which leaves both out on a
cluster this process started when no Ray Dataset is passed.

Each fit runs a two-worker training function that reports once (the fixed start-up and end of
a stage, nothing else) on a local cluster started as the pipeline starts its own
(`LOCAL_CLUSTER_ENV`). The variants take turns, their order rotated each round; a fit's figures
are its wall time and the whole machine's busy CPU seconds (/proc/stat) from its start to 3 s
after it returned, once its actors have exited. Run it on an otherwise idle machine.

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


def variants() -> dict[str, type]:
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

    from rlhf_core.distributed.cluster import StageTrainer

    class WithCleaner(StageTrainer):
        """StageTrainer as on a cluster it joined: the dataset manager out, the cleaner kept."""

        def _create_default_callbacks(self) -> list:
            return [c for c in TorchTrainer._create_default_callbacks(self) if not isinstance(c, DatasetsCallback)]

    return {"Ray Train's defaults (TorchTrainer)": TorchTrainer, "dataset manager left out": WithCleaner,
            "both left out (StageTrainer)": StageTrainer}


def helper_actors() -> dict[str, str]:
    import ray

    return {a: info["ActorClassName"] for a, info in ray._private.state.actors().items()  # noqa: SLF001
            if info["ActorClassName"] in ("DatasetManager", "PlacementGroupCleaner")}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from rlhf_core.distributed.cluster import LOCAL_CLUSTER_ENV, shutdown_ray, start_local_ray

    os.environ.update({k: os.environ.get(k, v) for k, v in LOCAL_CLUSTER_ENV.items()})
    start_local_ray(num_cpus=2, log_to_driver=False)
    kinds = variants()
    fits: dict[str, list[dict]] = {name: [] for name in kinds}
    storage = tempfile.mkdtemp(prefix="fit-helpers-")
    try:
        one_fit(kinds["both left out (StageTrainer)"], storage, "warm-up")  # the libraries in the page cache
        names = list(kinds)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                fits[name].append(one_fit(kinds[name], storage, f"r{r}-{len(fits[name])}-{kinds[name].__name__}"))
                print(f"round {r + 1}: {name}: {fits[name][-1]['wall_s']:.1f} s, {fits[name][-1]['cpu_s']:.1f} CPU-s",
                      flush=True)
    finally:
        shutdown_ray()
    rows = [{"trainer": name, "helper actors a fit": ", ".join(runs[0]["helpers"]) or "none",
             "wall_s": statistics.median(r["wall_s"] for r in runs), "wall_range": _range(runs, "wall_s"),
             "cpu_s": statistics.median(r["cpu_s"] for r in runs), "cpu_range": _range(runs, "cpu_s")}
            for name, runs in fits.items()]
    columns = ["trainer", "helper actors a fit", "wall_s", "wall_range", "cpu_s", "cpu_range"]
    print(table(rows, columns))
    ours, theirs = rows[-1], rows[0]
    print(f"StageTrainer against Ray Train's defaults, medians: {theirs['wall_s'] - ours['wall_s']:.1f} s and "
          f"{theirs['cpu_s'] - ours['cpu_s']:.1f} CPU-s less a fit ({theirs['cpu_s'] / ours['cpu_s']:.2f}x the CPU); "
          f"the cleaner alone {rows[1]['wall_s'] - ours['wall_s']:.1f} s and {rows[1]['cpu_s'] - ours['cpu_s']:.1f} CPU-s")
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(save("fit_helpers", {"rounds": args.rounds, "workers": 2, "settle_s": SETTLE_S, "rows": rows,
                               "fits": fits, "driver_peak_rss_mib": round(peak_mib)}))


def _range(runs: list[dict], key: str) -> str:
    return f"{min(r[key] for r in runs):.1f}-{max(r[key] for r in runs):.1f}"


if __name__ == "__main__":
    main()
