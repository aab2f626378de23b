"""What a policy-optimisation worker is given (`PolicyWorkerInputs`, built by the driver, crosses the
Ray boundary) and what one attempt of it holds for the whole run (`PolicyWorker`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf_core.config import PolicyConfig, ValidationConfig
from rlhf_core.distributed.stage import StageRuntime
from rlhf_core.distributed.worker_meter import WorkerMeter


@dataclass(frozen=True)
class PolicyWorkerInputs:
    """The settings and inputs of every worker of a policy run; it pickles."""

    runtime: StageRuntime
    cfg: PolicyConfig
    sft_dir: str  # the SFT policy: actor, reference, critic backbone and the engine's first weights
    reward_dir: str | None  # the reward model; None: verifiable reward only
    out_dir: str
    prompts: tuple[str, ...]
    eval_prompts: tuple[str, ...]
    eval_answers: tuple[str, ...]
    prompts_verifiable: bool  # every prompt parses for cfg.verifiable_reward
    answers: tuple[tuple[str, str], ...] = ()  # (prompt, answer) of the prompt set, for answer-checking rewards
    replay_pairs: tuple[dict[str, str], ...] = ()  # the reward model's training pairs, replayed in preference rounds
    queue_dir: str | None = None  # the labelling queue of rounds.annotator queue
    validation: ValidationConfig = ValidationConfig()  # the data contract new pairs pass
    answer_checker: str | None = None  # data.answer_checker: how accuracy judges an answer (None: exact text)


@dataclass
class PolicyWorker:
    """What one attempt of one worker holds for the whole run."""

    loop: PolicyWorkerInputs
    spec: Any  # rlhf_core.training.policy_step.AlgorithmSpec
    tokenizer: Any
    actor: Any  # DeepSpeed engine
    critic: Any  # DeepSpeed engine or None
    reference: torch.nn.Module | None  # None with LoRA: the actor with its adapters off
    reward_model: torch.nn.Module | None
    rm_stats: Any
    verifiable: Any  # fn(prompts, responses[, answers]) -> (B,) tensor, or None
    kl_controller: Any
    rank: int
    world: int
    engine: Any = None  # RolloutEngine on rank 0
    pipeline: Any = None  # RolloutPipeline on rank 0 when cfg.pipeline.max_lag > 0
    meter: WorkerMeter = field(default_factory=WorkerMeter)
    sync_checks: list[dict[str, Any]] = field(default_factory=list)  # rank 0, with policy.rollout.check_sync
    reward_tokenizer: Any = None  # the reward model's own (reward.base_model may differ from the policy)
    member_stats: tuple = ()  # RewardStats of each ensemble member (one: the model's own)
    audit: tuple | None = None  # (model, tokenizer, RewardStats) of the audit reward model, never trained against
    annotator: Any = None  # rank 0, with policy.rounds: rlhf_core.training.preference_rounds.Annotator
    precision: str = "fp32"  # what the trainer's passes compute in (`rlhf_core.training.precision`), one for all ranks
    stopped: str | None = None  # why the stage was asked to stop after its last step (`StageRuntime.agreed_stop`)

    @property
    def cfg(self) -> PolicyConfig:
        return self.loop.cfg

    @property
    def device(self) -> torch.device:
        """Where this worker trains: the actor's device (cuda:<local rank> on GPU), and so where
        its batches, reference, reward and audit models live."""
        return self.actor.device

    @property
    def max_length(self) -> int:
        """The longest sequence the reward model scores: the policy's context."""
        return self.actor.module.config.max_position_embeddings
