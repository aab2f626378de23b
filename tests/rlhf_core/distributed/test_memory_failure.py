"""A stage out of memory, on the exception objects Ray 2.60 raises.

`ray_oom_report.txt` is the text of the `ray.exceptions.OutOfMemoryError` a real kill produced
(a two-worker TorchTrainer on a local cluster started with a low RAY_memory_usage_threshold):
the raylet's report, verbatim. Ray Train wraps it as it does in `trainer.fit()`: a
`WorkerHealthCheckFailedError` per failed rank inside a `WorkerGroupError`, built by Ray Train's
own `WorkerGroupPollStatus`. The real kill itself is in test_memory_kill.py.
"""
from pathlib import Path

import pytest
import torch
from ray.exceptions import OutOfMemoryError
from ray.train import ControllerError, WorkerGroupError
from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
from ray.train.v2._internal.execution.worker_group.poll import (
    WorkerGroupPollStatus,
    WorkerStatus,
)

from rlhf_core.config import RewardConfig
from rlhf_core.distributed.memory_failure import (
    StageOutOfMemory,
    exception_chain,
    memory_failure_message,
    memory_kill,
    raise_if_out_of_memory,
    refusal,
)
from rlhf_core.models.memory import MachineMemory, ways_to_use_less

REPORT = (Path(__file__).parent / "ray_oom_report.txt").read_text()
GiB = 2**30
MACHINE = MachineMemory(total=24 * GiB, available=17 * GiB)


def worker_info(rank: int, pid: int) -> str:
    """The first line of Ray Train's health-check failure: the worker's info, as Ray Train writes it."""
    return (f"A worker health check failed.\nWorker info: Worker(\n  actor=Actor(RayTrainWorker, a0d7a738b4a409a6de3"
            f"69c7901000000),\n  metadata=ActorMetadata(\n    hostname='vm',\n    node_id='36baee01a09fc2dab0f30052a73d"
            f"3621cf3f87b9349da5b86f8cac0f',\n    node_ip='192.0.2.2',\n    pid={pid},\n  ),\n  distributed_context="
            f"DistributedContext(world_rank={rank}, world_size=2, local_rank={rank}, local_world_size=2, node_rank=0),\n)")


def worker_group_error(failures: dict[int, Exception]) -> WorkerGroupError:
    statuses = {rank: WorkerStatus(running=False, error=error) for rank, error in failures.items()}
    return WorkerGroupPollStatus(worker_statuses=statuses).get_worker_group_error()


def killed_worker() -> WorkerGroupError:
    return worker_group_error({1: WorkerHealthCheckFailedError(worker_info(1, 4382), failure=OutOfMemoryError(REPORT))})


def test_a_killed_worker_is_found_through_ray_train_s_wrapping():
    error = killed_worker()
    assert isinstance(error.worker_failures[1].health_check_failure, OutOfMemoryError)  # how fit() raises it
    assert any(isinstance(e, OutOfMemoryError) for e in exception_chain(error))
    kill = memory_kill(error)
    assert (kill.killed, kill.node_used_gib, kill.node_limit_gib, kill.threshold) == (3, 7.34, 23.54, 0.311)
    assert [(w.rank, w.pid, w.gib, w.killed) for w in kill.workers] == [(1, 4382, 1.59, True), (None, 4357, 1.39, False)]
    assert kill.own_error is None


def test_the_controller_killed_is_a_memory_kill_too():
    for error in (OutOfMemoryError(REPORT), ControllerError(OutOfMemoryError(REPORT))):
        assert memory_kill(error).killed == 3


def test_the_block_says_stage_workers_machine_and_settings_and_nothing_of_ray_s_dump():
    cfg = RewardConfig(num_workers=2, micro_batch_size=32, max_length=64)
    block = memory_failure_message("reward", memory_kill(killed_worker()), MACHINE, ways_to_use_less("reward", cfg))
    lines = block.splitlines()
    assert lines[0] == ("reward: out of memory: Ray's memory monitor killed 3 Ray processes, 1 of them a training "
                        "worker, when the node used 7.3 of 23.5 GiB (it kills above 31%)")
    assert lines[1] == "training workers' memory at the kill: rank 1, pid 4382: 1.6 GiB (killed); pid 4357: 1.4 GiB"
    assert lines[2].startswith("largest other processes: pid 2999 1.4 GiB .venv/bin/python -m pytest")
    assert lines[3] == "this machine at the stage's start: 24.0 GiB total, 17.0 GiB available (7.0 GiB already in use)"
    assert lines[4].startswith("to use less: reward.num_workers=2 (") and "reward.micro_batch_size=32" in lines[4]
    assert lines[4].endswith("or stop other processes that hold memory")
    assert len(lines) == 5 and len(block) < 1000
    for dump in ("Object store memory usage", "Refer to the documentation", "Worker info", "Traceback", "lease ID"):
        assert dump not in block


def test_the_stage_error_replaces_ray_s_and_keeps_it_as_the_cause():
    error = killed_worker()
    with pytest.raises(StageOutOfMemory) as caught:
        raise_if_out_of_memory("policy", error, MACHINE, None)
    assert caught.value.__cause__ is error  # the log's traceback keeps Ray's report
    assert str(caught.value).startswith("policy: out of memory:") and "policy.lora.enabled" in str(caught.value)


def test_other_failures_pass_through():
    crashed = worker_group_error({0: RuntimeError("loss is nan"), 1: ValueError("bad batch")})
    assert memory_kill(crashed) is None
    raise_if_out_of_memory("reward", crashed, MACHINE)  # returns: the caller re-raises Ray's error
    assert memory_kill(RuntimeError("collective timed out")) is None


def test_a_worker_s_own_allocation_failure_is_a_memory_failure():
    error = worker_group_error({0: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")})
    kill = memory_kill(error)
    assert kill.own_error == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    block = memory_failure_message("reward", kill, None, ["reward.max_length=64 (x)"])
    assert block.splitlines() == [
        ("reward: out of memory: a training worker could not allocate (OutOfMemoryError: CUDA out of memory. "
         "Tried to allocate 2.00 GiB)"),
        "to use less: reward.max_length=64 (x); or stop other processes that hold memory",
    ]


def test_a_reward_stage_larger_than_the_available_memory_is_refused(tmp_path, make_pretrained):
    path, model = make_pretrained(tmp_path, "llama")
    cfg = RewardConfig(num_workers=2, micro_batch_size=32, max_length=64)
    assert refusal("reward", cfg, str(path), MACHINE) is None
    message = refusal("reward", cfg, str(path), MachineMemory(total=24 * GiB, available=3 * GiB))
    first, advice = message.splitlines()
    params = sum(p.numel() for p in model.parameters())
    assert first.startswith(f"reward: out of memory, not started: the stage ({params / 1e6:.0f}M parameters on 2 "
                            "workers, micro-batches of 64 sequences of up to 64 tokens, ")
    assert "3.0 GiB available of 24.0 GiB total" in first
    assert advice.startswith("to use less: reward.num_workers=2")
    assert refusal("reward", cfg, str(tmp_path / "missing"), MachineMemory(24 * GiB, 0)) is None  # no estimate
    assert refusal("policy", object(), str(path), MachineMemory(24 * GiB, 0)) is None  # reward stages only
