"""Where a policy run stands, and its checkpoint: the actor and critic engines under the tags
`actor` and `critic`, every rank's RNG state, and this state (rank 0's copy) as
trainer_state.json (`rlhf_core.distributed.checkpoint`)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf_core.distributed.checkpoint import report_checkpoint, resume_latest
from rlhf_core.distributed.policy_loop import PolicyWorker
from rlhf_core.models.reward import RewardStats


@dataclass
class PolicyState:
    """Everything in it is checkpointed; every rank holds the same values."""

    step: int = 0
    kl_max: float = 0.0
    kl_final: float = math.nan
    nonfinite_skipped: int = 0
    consumed: list[list[int]] = field(default_factory=list)  # prompt indices per step
    evaluations: list[dict[str, float]] = field(default_factory=list)
    history: list[dict[str, float]] = field(default_factory=list)  # metrics of every committed step
    kl_controller: dict[str, float] = field(default_factory=dict)
    trip: dict[str, Any] | None = None  # the circuit breaker's Trip (as a dict) once it tripped
    # The reference policy's mean aggregated reward-model score and response length (tokens),
    # measured on the first step's rollouts (sampled from the SFT policy itself): what bounded
    # shaping and the length penalty are relative to.
    reference_score: float | None = None
    reference_length: float | None = None
    reference_samples: list[list[str]] = field(default_factory=list)  # [prompt, response] of the first step, all ranks
    # Preference rounds (`policy.rounds`): the pairs they added, the labels asked for, and the
    # reward model's normalisation after the last round (its weights are the checkpoint's `reward`).
    round_pairs: list[dict[str, str]] = field(default_factory=list)
    labels_asked: int = 0
    reward_member_stats: list[list[float]] | None = None
    reward_central_stats: list[float] | None = None
    audit_pairs: list[dict[str, str]] = field(default_factory=list)  # the rounds' pairs that trained the audit
    audit_stats: list[float] | None = None


class ModuleCheckpoint:
    """A plain torch module that is the same on every rank (the reward model, which preference
    rounds train), checkpointed beside the DeepSpeed engines with their interface: rank 0
    writes `<tag>/module.pt`, every rank loads it."""

    def __init__(self, module: torch.nn.Module, rank: int):
        self.module, self.rank = module, rank

    def save_checkpoint(self, directory: str, tag: str) -> None:
        if self.rank == 0:
            (Path(directory) / tag).mkdir(parents=True, exist_ok=True)
            torch.save(self.module.state_dict(), Path(directory) / tag / "module.pt")

    def load_checkpoint(self, directory: str, tag: str) -> tuple[str | None, None]:
        path = Path(directory) / tag / "module.pt"
        if not path.exists():
            return None, None
        self.module.load_state_dict(torch.load(path, weights_only=True))
        return str(path), None


def _engines(w: PolicyWorker) -> dict[str, Any]:
    engines = {"actor": w.actor, "critic": w.critic}
    if w.cfg.rounds.enabled and w.reward_model is not None:
        engines["reward"] = ModuleCheckpoint(w.reward_model, w.rank)
        if w.audit is not None:
            engines["audit"] = ModuleCheckpoint(w.audit[0], w.rank)
    return engines


def save_checkpoint(w: PolicyWorker, state: PolicyState, metrics: dict[str, float]) -> None:
    """Every rank: report a checkpoint of this step; returns once Ray Train has committed it."""
    report_checkpoint("policy", state.step, _engines(w), asdict(state), metrics, w.rank, w.world)


def resume(w: PolicyWorker) -> PolicyState | None:
    """Every rank: the latest committed checkpoint loaded into the engines, the RNGs and the KL
    controller; -> its state (None: a fresh start)."""
    saved = resume_latest("policy", _engines(w), w.rank, w.world)
    if saved is None:
        return None
    state = PolicyState(**saved)
    w.kl_controller.load_state_dict(state.kl_controller)
    if state.reward_member_stats is not None:  # a round changed the reward model's scale
        w.member_stats = tuple(RewardStats(m, s) for m, s in state.reward_member_stats)
        w.rm_stats = RewardStats(*state.reward_central_stats)
    if state.audit_stats is not None:
        w.audit = (w.audit[0], w.audit[1], RewardStats(*state.audit_stats))
    return state
