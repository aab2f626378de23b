"""The order the suite runs its modules in: the slowest first, from the last measured full run, and
which of `make test`'s two workers runs the slow ones."""
from __future__ import annotations

import json
from pathlib import Path

DURATIONS = Path(__file__).resolve().parents[1] / "bench" / "results" / "test_durations.json"  # bench/test_durations.py


def module_seconds(path: Path = DURATIONS) -> dict[str, float]:
    """Seconds per test module in the last measured full run (bench/test_durations.py); {} if none."""
    try:
        return {row["module"]: row["total"] for row in json.loads(path.read_text())["modules"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def longest_modules_first(items: list, seconds: dict[str, float]) -> None:
    """Reorder `items` in place, slowest module first (by `seconds`; an unmeasured module counts
    as 0), keeping each module's tests together and in their order. `make test` hands whole
    modules to its pytest-xdist workers in this order (`--dist loadfile`), so the long modules
    start first and do not leave one worker busy at the end while the other idles."""
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))


# What each of `make test`'s two workers runs first, in order: the slow modules, split as the
# suite's fastest measured runs on a 2-core machine split them (bench/results/
# test_durations_ci_after37, _after40 and _after42). Handed out in the order they free up, these
# modules paired differently from run to run, and some pairs slow each other down: two vLLM or
# Prometheus-heavy modules side by side on 2 cores each took 40-80 s longer than beside a lighter
# one. Fixed lanes keep the pairs that measured fastest. After its lane a worker takes the other
# modules, slowest first; when none is left it takes the last module of the other lane.
LANES: tuple[tuple[str, ...], ...] = (
    ("tests/flows/test_pipeline_flow.py", "tests/rlhf_core/distributed/test_reward_trainer.py",
     "tests/flows/test_tracking_server.py", "tests/flows/test_cli.py", "tests/rlhf_core/models/test_families.py",
     "tests/rlhf_core/distributed/test_engine_group.py", "tests/rlhf_core/models/test_gguf_import.py",
     "tests/rlhf_core/serving/test_gateway_serving.py"),
    ("tests/flows/test_resume.py", "tests/rlhf_core/distributed/test_policy_trainer.py",
     "tests/rlhf_core/distributed/test_offline_trainer.py", "tests/monitoring/test_alerting_e2e.py",
     "tests/rlhf_core/serving/test_server.py", "tests/tasks/test_tracking_server_errors.py",
     "tests/rlhf_core/distributed/test_multinode.py", "tests/rlhf_core/distributed/test_cluster.py",
     "tests/rlhf_core/eval/test_behaviour_on_smollm2.py"),
)


def next_module(queued: list[str], lane: int, lanes: tuple[tuple[str, ...], ...] = LANES) -> str:
    """The module worker `lane` runs next, of `queued` (the modules not handed out yet, slowest
    first): the first of its own lane still queued; else the first queued module of no lane; else
    the last queued module of another lane, the one its own worker would have run last."""
    waiting = set(queued)
    own = lanes[lane] if lane < len(lanes) else ()
    if ahead := [module for module in own if module in waiting]:
        return ahead[0]
    laned = {module for modules in lanes for module in modules}
    return next((module for module in queued if module not in laned), queued[-1])


def lane_scheduler(config, log=None, lanes: tuple[tuple[str, ...], ...] = LANES):
    """pytest-xdist's `--dist loadfile` (whole modules, slowest first) with each worker taking its
    lane's modules first (`next_module`), for a run on as many workers as there are `lanes` (`make
    test`); None (pytest-xdist's own scheduling) for any other run."""
    if config.getvalue("dist") != "loadfile" or config.getvalue("numprocesses") != len(lanes):
        return None
    from xdist.scheduler import LoadFileScheduling

    class LaneScheduling(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:
            module = next_module(list(self.workqueue), int(node.gateway.id.removeprefix("gw")), lanes)
            self.workqueue.move_to_end(module, last=False)  # the unit LoadFileScheduling hands out next
            super()._assign_work_unit(node)

    return LaneScheduling(config, log)
