"""Prefect task that makes a user's pretrained model the run's own, checked before anything trains.

The run's copy (`<output_dir>/models/base`, and `models/reward-base` for `reward.base_model`)
links the weights and completes the tokenizer and config (`rlhf_core.models.pretrained.materialise`);
`preflight` then names every reason the run could not use it: context, head size, memory.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil
from prefect import get_run_logger, task

from rlhf_core.chat import read_chat_template
from rlhf_core.config import PipelineConfig
from rlhf_core.models.pretrained import (
    VLLM_CPU_HEAD_SIZES, PretrainedError, PretrainedInfo, engine_gpu_problem, inspect_pretrained,
    engine_cache, is_hub_id, materialise, preflight,
)
from rlhf_core.models.memory import advice
from rlhf_core.models.gpu_room import (
    DEFAULT_GPU_BYTES, GpuNeed, gpu_memory_problem, offline_gpu_need, policy_gpu_need, reward_gpu_need,
)


@dataclass(frozen=True)
class PretrainedBase:
    policy: Path  # base of the policy, the reference and the critic
    reward: Path  # backbone of the reward model (the policy's unless reward.base_model is set)
    info: PretrainedInfo

    @property
    def context_length(self) -> int | None:
        return self.info.context_length

    def summary(self) -> dict:
        i = self.info
        return {"status": "ready", "model_type": i.model_type, "num_parameters": i.num_parameters,
                "context_length": i.context_length, "path": str(self.policy), "reward_backbone": str(self.reward)}


def _materialise(source: str, out_dir: Path, template: str | None, where: str) -> Path:
    if not is_hub_id(source):
        inspect_pretrained(source, where)  # a clear error for a directory that is not a model
    return materialise(source, out_dir, template)


def trains_on_this_machine(cfg: PipelineConfig, environ: Mapping[str, str]) -> bool:
    """Whether the training stages hold their models in this machine's memory: a local cluster
    (no $RAY_ADDRESS) training on CPUs. Stages told to use GPUs hold them in GPU memory, and
    those of another cluster in its nodes' memory."""
    return not environ.get("RAY_ADDRESS") and not (cfg.policy.use_gpu and cfg.reward.use_gpu)


def _gpu_problems(cfg: PipelineConfig, info: PretrainedInfo, reward: Path) -> list[str]:
    """Where the policy stage trains on GPUs: its estimate for rank 0's GPU, checked against the
    first GPU this process sees (a node of the kind the stages run on), else logged."""
    import torch  # noqa: PLC0415 - the flow's module loads without it

    if cfg.policy.use_gpu is False or (cfg.policy.use_gpu is None and not torch.cuda.is_available()):
        return []
    reward_info = info if reward == Path(info.path) else inspect_pretrained(reward)
    gpu = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    problem, estimate = gpu_memory_problem(info, cfg, gpu or DEFAULT_GPU_BYTES, reward_info.num_parameters)
    if gpu is None:
        get_run_logger().info("%s, for an 80 GiB device; this process sees no GPU to check it against (docs/gpu.md)",
                              estimate)
        return []
    get_run_logger().info(estimate)
    engines = engine_gpu_problem(info, cfg.policy, gpu) if cfg.policy.rollout.placement == "separate" else None
    rm = reward_gpu_need(reward_info, cfg.reward)
    rm_problem = None if rm.rank0 <= gpu else (
        f"reward.base_model: a reward-stage rank's GPU needs about {rm.rank0 / 2**30:.1f} GiB ({rm.parts}), more than "
        f"the device's {gpu / 2**30:.1f}\n" + advice(rm.ways))
    return [p for p in (problem, engines, rm_problem) if p]


def stage_gpu_need(stage: str, cfg: PipelineConfig, model: Path, reward: Path | None = None) -> GpuNeed | None:
    """What each rank of `stage` ("reward" | "policy") needs of its GPU, for the check every rank
    makes against its free memory when the stage starts (`rlhf_core.models.gpu_room`): from the
    trained model in `model` (and, for the RL policy stage, the reward model in `reward`). None
    where the stage will not use GPUs: told not to, or left to choose on a local cluster of a
    machine without one."""
    import torch  # noqa: PLC0415 - the flow's module loads without it

    use_gpu = getattr(cfg, stage).use_gpu
    if use_gpu is False or (use_gpu is None and not torch.cuda.is_available() and not os.environ.get("RAY_ADDRESS")):
        return None
    info = inspect_pretrained(model, f"{stage} model")
    if stage == "reward":
        return reward_gpu_need(info, cfg.reward)
    if cfg.policy.offline is not None:
        return offline_gpu_need(info, cfg.policy)
    gpu = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else DEFAULT_GPU_BYTES
    return policy_gpu_need(info, cfg, gpu, inspect_pretrained(reward, "reward model").num_parameters)


@task(name="prepare-pretrained")
def prepare_pretrained(cfg: PipelineConfig, out_dir: Path) -> PretrainedBase | None:
    """The run's pretrained base (None: the demo builds its own); raises `PretrainedError` naming
    every problem."""
    if cfg.model.pretrained is None:
        return None
    template = read_chat_template(cfg.model.chat_template) if cfg.model.chat_template else None
    policy = _materialise(cfg.model.pretrained, out_dir / "models" / "base", template, "model.pretrained")
    info = inspect_pretrained(policy)
    reward = policy
    if cfg.reward.base_model is not None:
        reward = _materialise(cfg.reward.base_model, out_dir / "models" / "reward-base", template, "reward.base_model")
    workers = max(cfg.policy.num_workers, cfg.reward.num_workers)
    memory = psutil.virtual_memory()  # what other processes hold is not ours to use
    here = trains_on_this_machine(cfg, os.environ)
    if not here:
        get_run_logger().info("the training stages run on GPUs or another cluster: this machine's memory is not "
                              "checked against them (per-GPU arithmetic: docs/gpu.md)")
    problems = preflight(
        info, max_total_tokens=cfg.reward.max_length,
        supported_head_sizes=None if cfg.policy.use_gpu else VLLM_CPU_HEAD_SIZES,
        needs_chat_template=False,  # the data stage knows whether the data is conversational
        workers=workers, with_critic=cfg.policy.algorithm == "ppo",
        memory_bytes=memory.total, available_bytes=memory.available, reward=cfg.reward, policy=cfg.policy,
        trains_here=here, **engine_cache(info, cfg),
    )
    problems += _gpu_problems(cfg, info, reward)
    reward_layers = info.num_layers if reward == policy else inspect_pretrained(reward, "reward.base_model").num_layers
    if cfg.reward.frozen_layers > reward_layers:
        problems.append(f"reward.frozen_layers is {cfg.reward.frozen_layers} but the reward model's backbone has "
                        f"{reward_layers} decoder layers; freeze at most {reward_layers}")
    if problems:
        raise PretrainedError("\n".join(problems))
    get_run_logger().info("pretrained %s: %s, %.1fM parameters, context %s", cfg.model.pretrained, info.model_type,
                          info.num_parameters / 1e6, info.context_length)
    return PretrainedBase(policy, reward, info)
