"""A preference round inside a policy run (`policy.rounds`), every rank.

Rank 0 samples two answers per fresh prompt from the engine (the current policy), has them
labelled, filters them through the data contract and continues training its reward model on
them with replay (`rlhf_core.training.preference_rounds`); then it broadcasts the new
weights and normalisation stats, and every rank loads them, so all ranks score the next
steps alike. The reference score of bounded shaping is measured again on the first step's
samples, in the new model's units. A share of each round's pairs (`rounds.audit_share`)
trains the audit reward model instead, which the policy never trains against: an audit
trained only on the offline pairs shares the proxy's blind spots (on the demo both rewarded
the same spurious carry), while one that sees the policy's own answers does not.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from rlhf_core.distributed import policy_rollouts as rollouts
from rlhf_core.distributed.fault_injection import fault_point, worker_point
from rlhf_core.distributed.policy_loop import PolicyWorker
from rlhf_core.distributed.policy_state import PolicyState
from rlhf_core.models.reward import RewardStats, score_members
from rlhf_core.rng import derive_seed
from rlhf_core.training.preference_rounds import (
    contract_filter,
    identical_items,
    make_annotator,
    module_state,
    replay_sample,
    split_for_audit,
    train_reward_model_round,
)
from rlhf_core.training.reward_shaping import aggregate_ensemble, normalise_members
from rlhf_core.training.verifiable import resolve_verifiable_reward, score_verifiable

COUNTS = ("asked", "labelled", "tie", "flipped", "malformed", "refused", "error", "queued", "picked_up")


def due(w: PolicyWorker, step: int) -> bool:
    rounds = w.cfg.rounds
    return rounds.enabled and w.reward_model is not None and step % rounds.every == 0 and step < w.cfg.steps


def annotator_for(w: PolicyWorker):
    """Rank 0's annotator; the simulated one judges with the task's verifiable reward."""
    cfg = w.cfg
    correct = None
    if cfg.verifiable_reward is not None:
        verifiable, answers = resolve_verifiable_reward(cfg.verifiable_reward), dict(w.loop.answers)
        correct = lambda prompts, responses: score_verifiable(verifiable, prompts, responses, answers)  # noqa: E731
    return make_annotator(cfg.rounds, correct, w.loop.queue_dir, seed=cfg.seed)


def run_round(w: PolicyWorker, state: PolicyState, step: int) -> dict[str, float]:
    """Every rank (collective): one round; -> its `rounds/*` metrics."""
    payload = _label_and_train(w, state, step) if w.rank == 0 else None
    received: list[Any] = [payload]
    dist.broadcast_object_list(received, src=0)
    payload = received[0]
    if payload["audit"] is not None:
        audit_model, audit_tokenizer, _ = w.audit
        audit_model.load_state_dict(payload["audit"]["weights"])
        w.audit = (audit_model, audit_tokenizer, RewardStats(*payload["audit"]["stats"]))
        state.audit_stats = payload["audit"]["stats"]
    state.audit_pairs.extend(payload["audit_pairs"])
    if payload["weights"] is not None:
        w.reward_model.load_state_dict(payload["weights"])
        w.member_stats = tuple(RewardStats(m, s) for m, s in payload["members"])
        w.rm_stats = RewardStats(*payload["central"])
        state.reward_member_stats, state.reward_central_stats = payload["members"], payload["central"]
        if state.reference_samples:
            state.reference_score = reference_score(w, state)
    state.round_pairs.extend(payload["new_pairs"])
    state.labels_asked += int(payload["metrics"].get("rounds/asked", 0))
    return payload["metrics"] | {"rounds/labels_total": float(state.labels_asked),
                                 "rounds/pairs_total": float(len(state.round_pairs))}


def round_id(w: PolicyWorker, step: int) -> str:
    """The round of `step` of this stage's run: the same in every attempt of the run (a resumed
    attempt redoes a round under its id, and a queue annotator hands it the labels the killed
    attempt took: exactly once), another in another run sharing the labelling queue."""
    return f"round-{w.loop.runtime.run_token}-step{step:04d}"


def _label_and_train(w: PolicyWorker, state: PolicyState, step: int) -> dict[str, Any]:
    start = time.perf_counter()
    cfg = w.cfg.rounds
    with rollouts.engine_at_newest(w):
        items = rollouts.round_items(w, step)
    items, identical = identical_items(items)
    annotated = w.annotator.annotate(items, round_id=round_id(w, step))
    fault_point(worker_point("policy-round", step, w.rank))  # a test kills here: labels taken, nothing trained
    new, dropped = contract_filter(annotated.pairs, w.loop.validation)
    metrics = {f"rounds/{k}": float(annotated.counts.get(k, 0)) for k in COUNTS}
    metrics |= {"rounds/identical": float(identical), "rounds/contract_dropped": float(dropped),
                "rounds/new_pairs": float(len(new))}
    new, audit_new = split_for_audit(new, cfg.audit_share if w.audit is not None else 0.0,
                                     derive_seed(w.cfg.seed, step, chunk=3))
    if not cfg.train_proxy:
        new = []
    metrics |= {"rounds/proxy_pairs": float(len(new)), "rounds/audit_pairs": float(len(audit_new))}
    audit = None
    if audit_new:
        audit_model, audit_tokenizer, _ = w.audit
        old = list(w.loop.replay_pairs) + state.audit_pairs
        replay = replay_sample(old, round(cfg.replay * len(audit_new)), derive_seed(w.cfg.seed, step, chunk=4))
        _, audit_stats, audit_metrics = train_reward_model_round(
            audit_model, audit_tokenizer, audit_new + replay, cfg, w.max_length, seed=derive_seed(w.cfg.seed, step, chunk=5))
        metrics |= {k.replace("rounds/rm_", "rounds/audit_"): v for k, v in audit_metrics.items()}
        audit = {"weights": module_state(audit_model), "stats": [audit_stats.mean, audit_stats.std]}
    weights = members = central = None
    if new:
        old = list(w.loop.replay_pairs) + state.round_pairs
        replay = replay_sample(old, round(cfg.replay * len(new)), derive_seed(w.cfg.seed, step, chunk=2))
        member_stats, central_stats, train_metrics = train_reward_model_round(
            w.reward_model, w.reward_tokenizer, new + replay, cfg, w.max_length, seed=derive_seed(w.cfg.seed, step))
        metrics |= train_metrics | {"rounds/replayed_pairs": float(len(replay))}
        weights = module_state(w.reward_model)
        members = [[m.mean, m.std] for m in member_stats]
        central = [central_stats.mean, central_stats.std]
    metrics["rounds/seconds"] = time.perf_counter() - start
    return {"weights": weights, "members": members, "central": central, "new_pairs": new, "audit": audit,
            "audit_pairs": audit_new, "metrics": metrics}


def aggregated_score(w: PolicyWorker, raw: torch.Tensor) -> torch.Tensor:
    """The ensemble's members (K, B) normalised and aggregated as `policy.shaping` says, before
    any clipping or shaping. -> (B,)"""
    members = normalise_members(raw, [m.mean for m in w.member_stats], [m.std for m in w.member_stats])
    return aggregate_ensemble(members, w.cfg.shaping.aggregate, w.cfg.shaping.std_coef)[0]


def reference_score(w: PolicyWorker, state: PolicyState) -> float:
    """The mean aggregated score of the first step's samples (the reference policy's) under the
    reward model as it is now."""
    prompts = [p for p, _ in state.reference_samples]
    responses = [r for _, r in state.reference_samples]
    raw = score_members(w.reward_model, w.reward_tokenizer, prompts, responses, max_length=w.max_length)
    return float(aggregated_score(w, raw).double().mean())
