"""A training stage out of memory, told in one block instead of Ray's several-kilobyte report.

Ray's memory monitor (in the raylet) kills worker processes once the node's used memory passes
`RAY_memory_usage_threshold` of its total. What `trainer.fit()` raises then depends on the
process it killed (Ray 2.60, Train V2):

- a training worker: `ray.train.WorkerGroupError`, whose `worker_failures[rank]` is a
  `WorkerHealthCheckFailedError` whose `health_check_failure` is `ray.exceptions.OutOfMemoryError`;
- the Train controller: the `OutOfMemoryError` itself (or a `ray.train.ControllerError` around it).

The `OutOfMemoryError`'s text is the raylet's report: the node's used memory and limit at the
kill, the processes it killed with their memory, the ten largest processes of the node.
`memory_kill` finds a memory failure anywhere in an exception's chain (a worker's own
`MemoryError` or `torch.OutOfMemoryError` counts too) and keeps those figures;
`memory_failure_message` writes the block: the stage, each training worker's memory at the
kill, the machine's memory at the stage's start, the settings that take memory off the stage. `refusal` is the check before training: the reward stage's estimate against what the
machine has available.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_core.config import RewardConfig
from rlhf_core.models.memory import (
    MachineMemory,
    advice,
    gib,
    memory_refusal,
    reward_stage_bytes,
    ways_to_use_less,
)
from rlhf_core.models.pretrained import PretrainedError, count_parameters

# The raylet's words (Ray 2.60's and the older single-task report's)
RAY_KILL_MARKERS = ("killed due to the node running low on memory", "Task was killed due to the node running low on memory")
_KILLED_COUNT = re.compile(r"(\d+) worker\(s\) were killed due to the node running low on memory")
_NODE = re.compile(r"Memory on the node \(IP: [^)]*\)[^\n]*? was ([\d.]+)GB (?:used )?/ ([\d.]+)GB")
_THRESHOLD = re.compile(r"threshold of \d+B \(([\d.]+)% of \d+B limit\)|memory usage threshold of ([\d.]+)")
# The raylet's own workers it weighed, those it killed marked "Selected to kill: "
_CONSIDERED = re.compile(
    r"^(Selected to kill: )?\([^\n]*?task name=([^,\n]+),[^\n]*?pid=(\d+), actual memory used=([\d.]+)GB", re.MULTILINE)
_TOP = re.compile(r"^(\d+)\t([\d.]+)\t([^\n]*)$", re.MULTILINE)
_PID = re.compile(r"\bpid=(\d+)")
TRAIN_WORKER = "RayTrainWorker"


class StageOutOfMemory(RuntimeError):
    """A stage that does not fit in memory: refused before training, or its workers killed.
    The message is the whole story, in one block."""


@dataclass(frozen=True)
class ProcessMemory:
    pid: int
    gib: float  # resident memory when Ray's memory monitor acted (its "GB" are 2**30 bytes)
    command: str
    rank: int | None = None  # the training worker's world rank, when Ray Train names it
    killed: bool = False


@dataclass(frozen=True)
class MemoryKill:
    """What a memory failure's exceptions say."""

    killed: int | None  # processes the memory monitor killed; None: not the monitor
    node_used_gib: float | None
    node_limit_gib: float | None
    threshold: float | None  # the monitor's kill threshold, a fraction of the limit
    workers: tuple[ProcessMemory, ...]  # the stage's training workers, largest first
    others: tuple[ProcessMemory, ...]  # the machine's largest other processes (Ray's top 10 less the cluster's)
    own_error: str | None  # a worker's own allocation failure (MemoryError, torch OOM): its first line


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and every exception it carries: causes and contexts, Ray Train's per-worker failures,
    health-check and controller failures, a task error's cause."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop(0)
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__, getattr(e, "health_check_failure", None),
                 getattr(e, "controller_failure", None), getattr(e, "cause", None)]
        failures = getattr(e, "worker_failures", None)
        if isinstance(failures, dict):
            todo += list(failures.values())


def _ranks_by_pid(exc: BaseException) -> dict[int, int]:
    """pid -> world rank, from Ray Train's per-worker failures (their worker info names the pid)."""
    ranks = {}
    for e in exception_chain(exc):
        for rank, failure in (getattr(e, "worker_failures", None) or {}).items():
            info = getattr(failure, "_message", None)  # WorkerHealthCheckFailedError: the worker info alone
            if isinstance(info, str) and (m := _PID.search(info)):
                ranks[int(m.group(1))] = rank
    return ranks


def _processes(report: str, ranks: dict[int, int]) -> tuple[tuple[ProcessMemory, ...], tuple[ProcessMemory, ...]]:
    """(the cluster's training workers, the machine's largest other processes), largest first.

    The workers are those the raylet weighed: the top-10 list is the whole machine's, where
    another cluster's training workers would be too."""
    top = {int(pid): (float(used), command.strip()) for pid, used, command in _TOP.findall(report)}
    ours: dict[int, ProcessMemory] = {}
    for selected, name, pid_text, used in _CONSIDERED.findall(report):
        pid = int(pid_text)
        ours[pid] = ProcessMemory(pid, max(float(used), top.get(pid, (0.0,))[0]), name.strip(), ranks.get(pid),
                                  killed=bool(selected) or (pid in ours and ours[pid].killed))
    workers = [p for p in ours.values() if TRAIN_WORKER in p.command]
    others = [ProcessMemory(pid, used, command) for pid, (used, command) in top.items() if pid not in ours]
    return (tuple(sorted(workers, key=lambda p: -p.gib)), tuple(sorted(others, key=lambda p: -p.gib)))


def memory_kill(exc: BaseException) -> MemoryKill | None:
    """The memory failure in `exc`'s chain, with the figures Ray's report gives; None when the
    failure is not one of memory."""
    from ray.exceptions import OutOfMemoryError  # noqa: PLC0415 - the driver's alone: a worker needs no Ray

    chain = list(exception_chain(exc))
    reports = ([str(e) for e in chain if isinstance(e, OutOfMemoryError)]
               or [str(e) for e in chain if any(m in str(e) for m in RAY_KILL_MARKERS)])
    if reports:
        report = "\n".join(dict.fromkeys(reports))  # one per failed rank, often the same
        count, node, threshold = _KILLED_COUNT.search(report), _NODE.search(report), _THRESHOLD.search(report)
        fraction = None
        if threshold:
            fraction = float(threshold.group(1)) / 100 if threshold.group(1) else float(threshold.group(2))
        workers, others = _processes(report, _ranks_by_pid(exc))
        return MemoryKill(
            killed=int(count.group(1)) if count else 1,
            node_used_gib=float(node.group(1)) if node else None,
            node_limit_gib=float(node.group(2)) if node else None,
            threshold=fraction, workers=workers, others=others, own_error=None,
        )
    own = next((e for e in chain if isinstance(e, (MemoryError, torch.OutOfMemoryError))), None)
    if own is None:
        return None
    first = (str(own).strip().splitlines() or [""])[0]
    return MemoryKill(None, None, None, None, (), (), own_error=f"{type(own).__name__}: {first}".rstrip(": "))


def _killed(kill: MemoryKill) -> str:
    """'3 Ray processes, 1 of them a training worker' and the like."""
    n, trainers = kill.killed, sum(w.killed for w in kill.workers)
    what = f"{n} Ray process{'es' if n != 1 else ''}"
    if trainers == 0:
        return f"{what}, {'none' if n != 1 else 'not'} a training worker"
    return f"{what}, {trainers} of them {'a training worker' if trainers == 1 else 'training workers'}"


def _worker_line(workers: Sequence[ProcessMemory]) -> str:
    if not workers:
        return "training workers' memory at the kill: not in Ray's report"
    parts = [f"{'' if w.rank is None else f'rank {w.rank}, '}pid {w.pid}: {w.gib:.1f} GiB{' (killed)' if w.killed else ''}"
             for w in workers]
    return "training workers' memory at the kill: " + "; ".join(parts)


def _others_line(kill: MemoryKill, limit: int = 3) -> str | None:
    if not kill.others:
        return None
    return "largest other processes: " + "; ".join(f"pid {p.pid} {p.gib:.1f} GiB {p.command[:48]}"
                                                  for p in kill.others[:limit])


def memory_failure_message(stage: str, kill: MemoryKill, machine: MachineMemory | None, ways: Sequence[str]) -> str:
    """The one block a stage killed for memory fails with."""
    if kill.own_error is not None:
        lines = [f"{stage}: out of memory: a training worker could not allocate ({kill.own_error})"]
    else:
        node = ""
        if kill.node_used_gib is not None:
            node = f" when the node used {kill.node_used_gib:.1f} of {kill.node_limit_gib:.1f} GiB"
            if kill.threshold is not None:
                node += f" (it kills above {kill.threshold:.0%})"
        lines = [f"{stage}: out of memory: Ray's memory monitor killed {_killed(kill)}{',' if node else ''}{node}",
                 _worker_line(kill.workers)]
        if (others := _others_line(kill)) is not None:
            lines.append(others)
    if machine is not None:
        lines.append(f"this machine at the stage's start: {machine.describe()}")
    lines.append(advice(ways))
    return "\n".join(lines)


def raise_if_out_of_memory(stage: str, exc: BaseException, machine: MachineMemory | None, cfg: Any = None) -> None:
    """Raise `StageOutOfMemory` (from `exc`, whose traceback goes to the log) when `exc` is a memory
    failure; return otherwise. `cfg` is the stage's config: the settings are named with their values."""
    refused = next((e for e in exception_chain(exc) if type(e) is StageOutOfMemory), None)
    if refused is not None:  # a rank refused to start (`stage.check_gpu_room`): its message is the stage's
        raise StageOutOfMemory(str(refused)) from exc
    kill = memory_kill(exc)
    if kill is not None:
        raise StageOutOfMemory(memory_failure_message(stage, kill, machine, ways_to_use_less(stage, cfg))) from exc


def model_shape(model_dir: str | Path) -> tuple[int, int, int] | None:
    """(parameters, layers, width) of a Hugging Face directory from its config.json and safetensors
    headers; None when they cannot be read (the estimate is skipped, never the stage)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        text = config.get("text_config") or config
        return count_parameters(Path(model_dir)), int(text["num_hidden_layers"]), int(text["hidden_size"])
    except (OSError, ValueError, KeyError, TypeError, PretrainedError):
        return None


def refusal(stage: str, cfg: Any, model_dir: str | None, machine: MachineMemory) -> str | None:
    """Before training: the message refusing a reward stage whose estimate (`reward_stage_bytes`)
    is more than `machine` can give it; None when it fits or cannot be estimated."""
    if not isinstance(cfg, RewardConfig) or model_dir is None or (shape := model_shape(model_dir)) is None:
        return None
    parameters, layers, width = shape
    need = reward_stage_bytes(parameters, layers, width, workers=cfg.num_workers,
                              micro_batch_size=cfg.micro_batch_size, max_length=cfg.max_length,
                              frozen_layers=cfg.frozen_layers)
    subject = (f"{stage}: out of memory, not started: the stage ({parameters / 1e6:.0f}M parameters on {cfg.num_workers} "
               f"workers, micro-batches of {2 * cfg.micro_batch_size} sequences of up to {cfg.max_length} tokens, "
               f"{gib(need / cfg.num_workers)} GiB a worker)")
    return memory_refusal(subject, need, machine, ways_to_use_less(stage, cfg))
