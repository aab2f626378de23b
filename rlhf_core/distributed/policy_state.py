"""Where a policy run stands, and its checkpoint: the actor and critic engines under the tags
`actor` and `critic`, every rank's RNG state, and this state (rank 0's copy) as
trainer_state.json (`rlhf_core.distributed.checkpoint`)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from rlhf_core.distributed.checkpoint import report_checkpoint, resume_latest
from rlhf_core.distributed.policy_loop import PolicyWorker


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


def _engines(w: PolicyWorker) -> dict[str, Any]:
    return {"actor": w.actor, "critic": w.critic}


def save_checkpoint(w: PolicyWorker, state: PolicyState, metrics: dict[str, float]) -> None:
    """Every rank: report a checkpoint of this step; returns once Ray Train has committed it."""
    report_checkpoint("policy", _engines(w), asdict(state), metrics, w.rank, w.world)


def resume(w: PolicyWorker) -> PolicyState | None:
    """Every rank: the latest committed checkpoint loaded into the engines, the RNGs and the KL
    controller; -> its state (None: a fresh start)."""
    saved = resume_latest("policy", _engines(w), w.rank, w.world)
    if saved is None:
        return None
    state = PolicyState(**saved)
    w.kl_controller.load_state_dict(state.kl_controller)
    return state
