"""What each rank of a training stage needs of its GPU, and the check every rank makes of it.

Before the run, `gpu_memory_problem` compares rank 0's GPU in the policy stage with the device's
size (docs/gpu.md's arithmetic). A device's size is not what a stage gets: a served champion,
another run or a stale process may hold part of it. So each stage carries its estimate per rank
(`GpuNeed`, built here by the tasks from the run's config and models), and every rank compares
it with what is free on its own GPU when the stage starts (`room_problem`, called by
`rlhf_core.distributed.stage.start_worker`), before it loads anything: a stage that cannot fit
stops at once, naming the rank, the GPU and what holds it, instead of running out of memory
minutes later.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlhf_core.models.memory import GpuPolicyShape, advice, gib, gpu_policy_bytes, ipc_buffer_bytes, ways_to_use_less
from rlhf_core.models.pretrained import PretrainedInfo, engine_gpu_share, engine_weight_bytes

if TYPE_CHECKING:
    from rlhf_core.config import PipelineConfig, PolicyConfig, RewardConfig

DEFAULT_GPU_BYTES = 80 * 2**30  # assumed where the driver sees no GPU (a KubeRay head pod): an H100's


@dataclass(frozen=True)
class GpuNeed:
    """A stage's GPU estimate per rank, in bytes: rank 0 (which holds a colocated rollout engine)
    and every other rank; `parts` says what it is made of, `ways` what takes memory off it."""

    stage: str
    rank0: int
    others: int
    parts: str
    ways: tuple[str, ...] = ()

    def of(self, rank: int) -> int:
        return self.rank0 if rank == 0 else self.others


def room_problem(need: GpuNeed, rank: int, free: int, total: int, gpu: str) -> str | None:
    """None when `free` bytes of this rank's GPU (`gpu`: its name, host and index) hold its part of
    the stage; else the message that stops the stage."""
    wanted = need.of(rank)
    if free >= wanted:
        return None
    held = total - free
    return "\n".join([
        f"{need.stage}: not started: rank {rank}'s GPU ({gpu}) has {gib(free)} GiB free of {gib(total)}, and the "
        f"stage needs about {gib(wanted)} GiB there ({need.parts})",
        f"other processes hold {gib(held)} GiB of it: `nvidia-smi` on that host names them (a served model, another "
        "run, a process left over); or run the stage on other GPUs",
        advice(need.ways),
    ])


def policy_parts(info: PretrainedInfo, cfg: PipelineConfig, gpu_bytes: int,
                  reward_parameters: int) -> tuple[int, dict[str, int], bool]:
    """(rank 0's peak, its parts, whether the engine sleeps during the update) in the RL policy
    stage: the trainer's parts (`gpu_policy_bytes`) plus the engine's share of a `gpu_bytes`
    device. An engine that sleeps during the update holds its share while it generates, when the
    trainer holds no activations or logits, and none during the update."""
    policy = cfg.policy
    frozen = reward_parameters * (2 if cfg.reward.audit_share > 0 else 1) + (0 if policy.lora.enabled else info.num_parameters)
    parts = gpu_policy_bytes(_shape(
        info, frozen_parameters=frozen, workers=policy.num_workers,
        zero_stage=policy.zero_stage, lora=policy.lora.enabled, with_critic=policy.algorithm == "ppo",
        micro_batch_size=policy.micro_batch_size, sequence_tokens=cfg.reward.max_length,
        response_tokens=policy.max_new_tokens, gradient_checkpointing=policy.gradient_checkpointing))
    separate = policy.rollout.placement == "separate"  # engines on GPUs of their own: none on rank 0's
    parts["engine"] = 0 if separate else int(engine_gpu_share(info, cfg, gpu_bytes) * gpu_bytes)
    need = sum(parts.values())
    sleeps = not separate and (policy.rollout.sleep if policy.rollout.sleep is not None else policy.pipeline.max_lag == 0)
    if sleeps:  # the engine's memory is free during the update, the trainer's passes are done while it generates
        need = max(need - parts["engine"], need - parts["activations"] - parts["logits"])
    # a streamed sync to a colocated engine (CUDA IPC) stages the weights in a buffer on this GPU,
    # the trainer's passes done and the engine awake (a sleeping one has woken its weights only):
    # the peak only where the buffer outweighs what the update holds
    buffer = 0 if separate or policy.rollout.weight_sync == "file" else ipc_buffer_bytes(info)
    engine_at_sync = engine_weight_bytes(info, policy) if sleeps else parts["engine"]
    need = max(need, sum(parts.values()) - parts["activations"] - parts["logits"] - parts["engine"] + engine_at_sync
               + buffer)
    return need, parts, sleeps


def gpu_memory_problem(info: PretrainedInfo, cfg: PipelineConfig, gpu_bytes: int, reward_parameters: int,
                       where: str = "model.pretrained") -> tuple[str | None, str]:
    """(refusal or None, the estimate in words) for rank 0's GPU in the policy stage against a
    device of `gpu_bytes` (`policy_parts`)."""
    need, parts, sleeps = policy_parts(info, cfg, gpu_bytes, reward_parameters)
    estimate = (f"rank 0's GPU in the policy stage: about {gib(need)} GiB of {gib(gpu_bytes)} ("
                + ", ".join(f"{name} {gib(n)}" for name, n in parts.items())
                + (", the engine asleep during the update" if sleeps else "") + ")")
    if need <= gpu_bytes:
        return None, estimate
    return f"{where}: {estimate}, more than the device holds\n{advice(_policy_ways(info, cfg, gpu_bytes))}", estimate


def _policy_ways(info: PretrainedInfo, cfg: PipelineConfig, gpu_bytes: int) -> list[str]:
    policy = cfg.policy
    ways = [f"policy.rollout.gpu_memory_utilization={engine_gpu_share(info, cfg, gpu_bytes):.2f} (the engine's share)",
            *ways_to_use_less("policy", policy)]
    if policy.zero_stage < 3:
        ways.append(f"policy.zero_stage={policy.zero_stage} (3 shards the actor's weights over the workers)")
    return ways


def _words(parts: dict[str, int]) -> str:
    return ", ".join(f"{name} {gib(n)}" for name, n in parts.items() if n)


def policy_gpu_need(info: PretrainedInfo, cfg: PipelineConfig, gpu_bytes: int, reward_parameters: int) -> GpuNeed:
    """The RL policy stage's: rank 0 as `gpu_memory_problem` counts it, the other ranks without
    the engine (on a device of `gpu_bytes`, which sets a configured engine share's size)."""
    need, parts, _ = policy_parts(info, cfg, gpu_bytes, reward_parameters)
    others = sum(parts.values()) - parts["engine"]
    return GpuNeed("policy", need, others, _words(parts) + f"; estimated for a device of {gib(gpu_bytes)} GiB",
                   tuple(_policy_ways(info, cfg, gpu_bytes)))


def _shape(info: PretrainedInfo, **settings) -> GpuPolicyShape:
    return GpuPolicyShape(parameters=info.num_parameters, num_layers=info.num_layers, hidden_size=info.hidden_size,
                          kv_width=info.num_kv_heads * info.head_dim,
                          intermediate_size=info.intermediate_size or 4 * info.hidden_size,
                          vocab_size=info.vocab_size, **settings)


def reward_gpu_need(info: PretrainedInfo, reward: RewardConfig) -> GpuNeed:
    """A reward-stage rank's (the audit model's run after it needs the same): the trained model
    under ZeRO `reward.zero_stage`, a micro-batch's chosen and rejected sequences at
    `reward.max_length`, no LM head's logits (a scalar head)."""
    parts = gpu_policy_bytes(_shape(info, frozen_parameters=0, workers=reward.num_workers,
                                    zero_stage=reward.zero_stage, micro_batch_size=2 * reward.micro_batch_size,
                                    sequence_tokens=reward.max_length, response_tokens=0))
    need = sum(parts.values())
    return GpuNeed("reward", need, need, _words(parts), tuple(ways_to_use_less("reward", reward)))


def offline_gpu_need(info: PretrainedInfo, policy: PolicyConfig) -> GpuNeed:
    """A DPO / KTO rank's: the actor, its frozen reference beside it (none with LoRA: the actor with
    its adapters off), a micro-batch's chosen and rejected sequences at the stage's `max_length`
    and their logits (every position counted: an upper bound)."""
    d = policy.offline
    parts = gpu_policy_bytes(_shape(info, frozen_parameters=0 if policy.lora.enabled else info.num_parameters,
                                    workers=policy.num_workers, zero_stage=policy.zero_stage, lora=policy.lora.enabled,
                                    micro_batch_size=2 * d.micro_batch_size, sequence_tokens=d.max_length,
                                    response_tokens=d.max_length,
                                    gradient_checkpointing=policy.gradient_checkpointing))
    need = sum(parts.values())
    return GpuNeed("policy", need, need, _words(parts), tuple(ways_to_use_less("policy", policy)))
