"""The plumbing both trainers share, without a cluster: what crosses the Ray boundary, the
checkpoint's world-size guard, the fault hooks."""
from __future__ import annotations

import json
import pickle

import pytest
import ray.cloudpickle

from rlhf_core.config import PolicyConfig, RewardConfig
from rlhf_core.distributed.checkpoint import STATE_FILE, _load
from rlhf_core.distributed.fault_injection import FAULT_ENV, NanOnce, fault_point, nan_if_due, worker_point
from rlhf_core.distributed.policy_loop import PolicyWorkerInputs
from rlhf_core.distributed.reward_trainer import RewardWorkerInputs
from rlhf_core.distributed.stage import StageRuntime


def test_the_worker_settings_pickle_as_typed_objects(tmp_path):
    runtime = StageRuntime("policy", False, str(tmp_path / "a.jsonl"), on_metrics=None)
    loop = PolicyWorkerInputs(runtime, PolicyConfig(verifiable_reward=None, verifiable_reward_weight=0.0), "sft", None, "out",
                      ("01+02=",), ("03+04=",), ("007",), prompts_verifiable=False)
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


def test_fault_hooks_fire_only_where_they_are_aimed(tmp_path, monkeypatch):
    killed = tmp_path / "killed"
    monkeypatch.setenv(FAULT_ENV, f"kill:reward:step3:rank1={killed}")
    fault_point(worker_point("reward", 3, 0))  # another rank: lives
    fault_point(worker_point("reward", 2, 1))  # another step: lives
    fault_point(worker_point("policy", 3, 1))  # another stage: lives
    killed.touch()
    fault_point(worker_point("reward", 3, 1))  # killed once already (its file exists): the retried worker lives
    assert worker_point("reward", 3, 1) == "reward:step3:rank1"

    def step(loss, boundary):
        return loss

    monkeypatch.setenv(FAULT_ENV, "nan:policy:step2:rank0")
    assert nan_if_due(step, worker_point("policy", 1, 0)) is step
    monkeypatch.delenv(FAULT_ENV)
    assert nan_if_due(step, worker_point("policy", 2, 0)) is step
    monkeypatch.setenv(FAULT_ENV, "nan:policy:step2:rank0")
    poisoned = nan_if_due(step, worker_point("policy", 2, 0))
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


def test_the_held_out_pass_runs_on_the_stages_gpu_where_its_models_fit_else_on_the_cpu(monkeypatch, capsys):
    import torch

    from rlhf_core.distributed.stage import evaluation_device

    assert evaluation_device(torch.device("cpu"), 10**12, "reward") == torch.device("cpu")
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * 2**30, 80 * 2**30))
    gpu = torch.device("cuda", 0)
    assert evaluation_device(gpu, 20 * 2**30, "reward") == gpu and emptied  # 25 GiB with activations: fits
    assert evaluation_device(gpu, 28 * 2**30, "policy") == torch.device("cpu")
    assert "policy: the held-out pass needs about 28.0 GiB, 30.0 GiB are free on cuda:0: it runs on the CPU" in \
        capsys.readouterr().out
