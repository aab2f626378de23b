"""SFT and the gates' evaluation as Ray tasks with the policy stage's resources, on the shared
local cluster: each runs in a worker process of its own, on the CPU here (a GPU where the
cluster has one), and gives exactly what the same function gives in this process."""
from __future__ import annotations

import os
import sys

import pytest
import ray.cloudpickle
import torch

from rlhf_core.config import PipelineConfig
from rlhf_core.distributed.stage_task import run_stage_task
from rlhf_core.eval.gate_models import GateModels, evaluate_on
from rlhf_core.data.schema import read_table
from rlhf_core.data.synthetic import generate_demo_data
from rlhf_core.models.llama import load_policy, save_pretrained_atomic
from rlhf_core.training.base_policy import make_base_policy, make_base_policy_on
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


@pytest.mark.slow
def test_the_gates_judge_the_answers_of_an_engine_of_servings_kind_and_dtype_one_at_a_time(demo, candidate):
    from rlhf_core.rollout.factory import open_serving_engine
    from rlhf_core.training.verifiable import check_answers

    cpu, cfg = torch.device("cpu"), CFG.model_copy(update={"serving": CFG.serving.model_copy(update={"dtype": "bfloat16"})})
    opened = []

    def serving_engine(model_dir, max_num_seqs, max_model_len):
        engine = open_serving_engine(model_dir, cfg.serving, cpu, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        opened.append((model_dir, engine.llm.llm_engine.model_config.dtype, max_num_seqs, max_model_len))
        return engine

    prompts, answers = demo["eval_prompts"], demo["eval_answers"]
    result = evaluate_on(cpu, GateModels(candidate, demo["sft"], demo["rm"]), prompts, answers, cfg,
                         open_engine=serving_engine)
    assert result.num_prompts == 16
    assert [(d, dtype, seqs) for d, dtype, seqs, _ in opened] == [(candidate, torch.bfloat16, 16), (demo["sft"], torch.bfloat16, 16)]
    engine = serving_engine(candidate, 16, opened[0][3])
    try:
        direct = [r.response_text for r in engine.generate(prompts[:16], n=1, temperature=0.0, max_tokens=4)]
    finally:
        engine.close()
    assert result.candidate.samples == list(zip(prompts[:3], direct[:3]))
    assert result.candidate.figures.accuracy == sum(check_answers(prompts[:16], direct, answers[:16], None)) / 16


@pytest.mark.slow
def test_sft_as_a_ray_task_trains_the_same_weights_as_in_this_process(ray_cluster, tmp_path):
    from safetensors.torch import load_file

    cfg = PipelineConfig.model_validate({
        "data": {"demo": {"seed": 0, "n_sft": 256, "n_pairs": 16, "n_eval": 16}},
        "model": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2},
        "sft": {"epochs": 1, "batch_size": 32, "min_eval_accuracy": 0.0},
    })
    files = generate_demo_data(cfg.data.demo, tmp_path / "data")
    sft, evals = read_table(files.sft), read_table(files.eval)
    args = (list(sft["prompt"]), list(sft["completion"]), list(sft["prompt"] + sft["completion"]), list(evals["prompt"]),
            list(evals["answer"]), cfg)
    there, where = run_stage_task("sft", make_base_policy_on, *args, tmp_path / "there", use_gpu=None,
                                  settings="policy")
    threads = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # as the task has them
    try:
        here = make_base_policy(*args, tmp_path / "here")
    finally:
        torch.set_num_threads(threads)
    assert where.startswith("cpu of ") and (there.sft_steps, there.eval_accuracy) == (here.sft_steps, here.eval_accuracy)
    a, b = load_file(there.path / "model.safetensors"), load_file(here.path / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
