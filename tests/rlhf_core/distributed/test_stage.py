"""The plumbing both trainers share, without a cluster: what crosses the Ray boundary, the
checkpoint's world-size guard, the fault hooks."""
from __future__ import annotations

import json
import pickle

import pytest
import ray.cloudpickle

from rlhf_core.config import PolicyConfig, RewardConfig
from rlhf_core.distributed.checkpoint import STATE_FILE, _load
from rlhf_core.distributed.fault_injection import KillWorkerOnce, NanAtStep, NanOnce, kill_if_due, nan_if_due
from rlhf_core.distributed.policy_loop import PolicyWorkerInputs
from rlhf_core.distributed.reward_trainer import RewardWorkerInputs
from rlhf_core.distributed.stage import StageRuntime


def test_the_worker_settings_pickle_as_typed_objects(tmp_path):
    runtime = StageRuntime("policy", False, str(tmp_path / "a.jsonl"), on_metrics=None,
                           kill_once=KillWorkerOnce(1, 3, tmp_path / "killed"))
    loop = PolicyWorkerInputs(runtime, PolicyConfig(verifiable_reward=None, verifiable_reward_weight=0.0), "sft", None, "out",
                      ("01+02=",), ("03+04=",), ("007",), prompts_verifiable=False, nan_at=NanAtStep(0, 2))
    for dumps, loads in ((pickle.dumps, pickle.loads), (ray.cloudpickle.dumps, ray.cloudpickle.loads)):
        back = loads(dumps(loop))
        assert back == loop and isinstance(back.cfg, PolicyConfig) and back.cfg.verifiable_reward is None
    with pytest.raises(AttributeError):
        loop.prompts = ()  # frozen: a worker cannot change what the others were given
    reward = RewardWorkerInputs(runtime, RewardConfig(), "base", "out", train=None, evals=None)
    assert pickle.loads(pickle.dumps(reward)) == reward


def test_a_checkpoint_from_another_world_size_is_refused(tmp_path):
    (tmp_path / STATE_FILE).write_text(json.dumps({"world_size": 2, "step": 4}))
    with pytest.raises(ValueError, match="written by 2 workers, this run has 1; ZeRO shards cannot be re-split"):
        _load("policy", {}, tmp_path, rank=0, world=1)


def test_fault_hooks_fire_only_where_they_are_aimed(tmp_path):
    kill = KillWorkerOnce(rank=1, at_step=3, marker=tmp_path / "killed")
    kill_if_due(kill, rank=0, step=3)  # another rank: lives
    kill_if_due(kill, rank=1, step=2)  # another step: lives
    kill_if_due(None, rank=1, step=3)
    assert not kill.marker.exists()

    def step(loss, boundary):
        return loss

    assert nan_if_due(step, NanAtStep(rank=0, step=2), rank=0, step=1) is step
    assert nan_if_due(step, None, rank=0, step=2) is step
    poisoned = nan_if_due(step, NanAtStep(rank=0, step=2), rank=0, step=2)
    assert isinstance(poisoned, NanOnce)
    first, second = poisoned(1.0, True), poisoned(1.0, True)
    assert first != first and second == 1.0  # NaN once, then the loss as given


def test_a_cpu_worker_gets_its_share_of_the_nodes_cores():
    from rlhf_core.distributed.stage import cpu_threads

    assert cpu_threads(1, cores=2) == 2  # one worker: the whole machine, not Ray's one CPU
    assert cpu_threads(2, cores=2) == 1
    assert cpu_threads(3, cores=16) == 5
    assert cpu_threads(4, cores=2) == 1  # never below one
    assert cpu_threads(1) >= 1
