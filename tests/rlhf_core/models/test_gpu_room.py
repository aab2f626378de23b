"""Each rank's GPU estimate of a stage, and the check every rank makes of its free memory when
the stage starts: closed forms against docs/gpu.md's arithmetic, the refusal's message, and
the path of a rank's refusal out of Ray Train to the caller (CUDA's memory query replaced: no
GPU here)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_core.config.loading import load_config
from rlhf_core.distributed.memory_failure import StageOutOfMemory, raise_if_out_of_memory
from rlhf_core.models.gpu_room import (
    GpuNeed, gpu_memory_problem, offline_gpu_need, policy_gpu_need, reward_gpu_need, room_problem,
)

from .test_pretrained import qwen_05b_info

REPO = Path(__file__).resolve().parents[3]
GIB = 2**30
ONE_GPU = load_config(REPO / "configs" / "gpu-1xh100-0.5b.yaml")


def test_a_reward_rank_needs_its_model_and_optimizer_the_activations_of_a_micro_batch_and_the_overhead():
    """docs/gpu.md (a): 7.4 (weights, gradients, master weights and moments) + 19.9 (16 sequences
    of 1,024 tokens) + 3 = about 30 GiB; no logits (a scalar head)."""
    need = reward_gpu_need(qwen_05b_info(), ONE_GPU.reward)
    n, tokens, per_token_layer = 494_000_000, 2 * 8 * 1024, 2 * (8 * 896 + 4 * 128 + 4 * 4864)
    assert need.rank0 == need.others == 16 * n + tokens * 24 * per_token_layer + 3 * GIB
    assert f"{need.rank0 / GIB:.1f}" == "30.2" and "logits" not in need.parts
    zero3 = reward_gpu_need(qwen_05b_info(), ONE_GPU.reward.model_copy(update={"num_workers": 4, "zero_stage": 3}))
    assert need.rank0 - zero3.rank0 == 16 * n - 16 * n // 4  # every part of the model state sharded


def test_the_policy_stages_rank_0_is_the_preflights_figure_and_the_other_ranks_hold_no_engine():
    need = policy_gpu_need(qwen_05b_info(), ONE_GPU, 80 * GIB, reward_parameters=494_000_000)
    _, estimate = gpu_memory_problem(qwen_05b_info(), ONE_GPU, 80 * GIB, reward_parameters=494_000_000)
    assert f"about {need.rank0 / GIB:.1f} GiB of 80.0" in estimate  # 27.3, the engine asleep
    assert f"{need.others / GIB:.1f}" == "22.1"  # docs/gpu.md (a)'s trainer, without the engine's 14.2
    assert "engine 14.2" in need.parts and any("gpu_memory_utilization" in w for w in need.ways)


def test_a_dpo_rank_holds_its_reference_beside_it_unless_lora_turns_the_adapters_off():
    dpo = ONE_GPU.policy.model_copy(update={"algorithm": "dpo"})
    full = offline_gpu_need(qwen_05b_info(), dpo)
    lora = offline_gpu_need(qwen_05b_info(), dpo.model_copy(update={"lora": dpo.lora.model_copy(update={"enabled": True})}))
    n = 494_000_000
    assert "frozen 0.9" in full.parts and "frozen" not in lora.parts
    assert full.rank0 - lora.rank0 == 2 * n + (16 * n - 2 * n)  # the reference, and the full model state


NEED = GpuNeed("policy", rank0=30 * GIB, others=20 * GIB, parts="actor 7.4, engine 14.2", ways=("policy.x=1 (why)",))


def test_a_rank_whose_gpu_has_room_passes_and_one_whose_gpu_is_held_is_refused_naming_what_to_do():
    assert room_problem(NEED, 0, 30 * GIB, 80 * GIB, "H100, cuda:0 on a") is None
    assert room_problem(NEED, 1, 20 * GIB, 80 * GIB, "H100, cuda:1 on a") is None  # no engine on rank 1
    refused = room_problem(NEED, 0, 25 * GIB, 80 * GIB, "H100, cuda:0 on node-3")
    assert refused.splitlines() == [
        "policy: not started: rank 0's GPU (H100, cuda:0 on node-3) has 25.0 GiB free of 80.0, and the stage needs "
        "about 30.0 GiB there (actor 7.4, engine 14.2)",
        "other processes hold 55.0 GiB of it: `nvidia-smi` on that host names them (a served model, another run, a "
        "process left over); or run the stage on other GPUs",
        "to use less: policy.x=1 (why); or stop other processes that hold memory",
    ]


def test_a_worker_on_a_gpu_held_by_a_served_model_stops_before_loading_and_the_stage_says_why(monkeypatch):
    """`start_worker`'s check on a GPU with 10 of 80 GiB free, and Ray Train's failure around it as
    the driver gets it: the caller sees the rank's message, not a traceback."""
    from rlhf_core.distributed import stage

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    with pytest.raises(StageOutOfMemory) as refused:
        stage.check_gpu_room(NEED, rank=1)
    assert str(refused.value).startswith("policy: not started: rank 1's GPU (NVIDIA H100 80GB HBM3, cuda:0 on ")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (79 * GIB, 80 * GIB))
    stage.check_gpu_room(NEED, rank=0)  # room: nothing said

    class WorkerGroupError(RuntimeError):  # the shape of ray.train's: the ranks' own exceptions by rank
        def __init__(self, failures):
            super().__init__("Worker group failed")
            self.worker_failures = failures

    failed = RuntimeError("Training failed")
    failed.__cause__ = WorkerGroupError({1: refused.value})
    with pytest.raises(StageOutOfMemory) as told:
        raise_if_out_of_memory("policy", failed, None)
    assert str(told.value) == str(refused.value)
    raise_if_out_of_memory("policy", RuntimeError("something else"), None)  # not a memory failure: returns
