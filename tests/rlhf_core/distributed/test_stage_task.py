"""The gates' evaluation as a Ray task with the policy stage's resources, on the shared local
cluster: it runs in a worker process of its own, on the CPU here (a GPU where the cluster has
one), and judges exactly as the same function in this process does."""
from __future__ import annotations

import os
import sys

import pytest
import ray.cloudpickle
import torch

from rlhf_core.config import PipelineConfig
from rlhf_core.distributed.stage_task import run_stage_task
from rlhf_core.eval.gate_models import GateModels, evaluate_on
from rlhf_core.models.llama import load_policy, save_pretrained_atomic
from rlhf_core.tokenizer import load_tokenizer

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = PipelineConfig.model_validate({"policy": {"max_new_tokens": 4},
                                     "gates": {"eval_prompts": 16, "bootstrap_samples": 200}})


def _pid(device: torch.device) -> tuple[int, int]:
    return os.getpid(), torch.get_num_threads()


def _raises(device: torch.device) -> None:
    raise ValueError("no eval prompts")


@pytest.fixture(scope="module")
def candidate(demo, tmp_path_factory):
    """The demo's SFT policy with its output layer scaled: another policy on the same vocabulary."""
    model = load_policy(demo["sft"])
    with torch.no_grad():
        model.lm_head.weight.mul_(1.3)
    return save_pretrained_atomic(model, load_tokenizer(demo["sft"]), tmp_path_factory.mktemp("candidate") / "policy")


@pytest.mark.slow
def test_the_gates_run_as_a_ray_task_on_the_stages_device_and_judge_as_they_do_in_this_process(
        ray_cluster, demo, candidate):
    (pid, threads), where = run_stage_task("evaluate", _pid, use_gpu=None, settings="policy")
    assert pid != os.getpid() and where.startswith("cpu of ")
    assert threads == len(os.sched_getaffinity(0))  # every core of the node, as the driver had
    with pytest.raises(ValueError, match="no eval prompts"):  # the task's own error, as it was raised there
        run_stage_task("evaluate", _raises, use_gpu=None, settings="policy")
    with pytest.raises(ValueError, match=r"policy.use_gpu is true but"):
        run_stage_task("evaluate", _pid, use_gpu=True, settings="policy")

    models = GateModels(candidate, demo["sft"], demo["rm"])
    prompts, answers = demo["eval_prompts"], demo["eval_answers"]
    there, _ = run_stage_task("evaluate", evaluate_on, models, prompts, answers, CFG, use_gpu=None, settings="policy")
    here = evaluate_on(torch.device("cpu"), models, prompts, answers, CFG)
    assert there.metrics() == here.metrics()
    assert there.candidate.figures.kl_to_reference > 0 and there.reference.figures.win_rate_vs_reference == 0.5
