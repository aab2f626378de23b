"""The flat metrics of one RL step, from what every rank gathered."""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np


class PolicyRankStep(NamedTuple):
    """What each rank hands the others after an RL step (the all-gather)."""

    seconds: float
    rollouts: dict[str, Any]  # its rollouts' figures: scores, rm, verifiable, kl, ...
    update: dict[str, Any]  # its update's figures: entropy, clipfrac, grad_norm, ...
    tokens: int  # the tokens of its batch
    worker: dict[str, Any]  # its WorkerMeter's figures


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def step_metrics(gathered: list[PolicyRankStep], timings: dict[str, float], kl_coef: float, sync_s: float
                 ) -> dict[str, float]:
    """Flat metrics of one step from every rank's PolicyRankStep."""
    times = [g.seconds for g in gathered]
    local = [g.rollouts for g in gathered]
    update = [g.update for g in gathered]
    scores = [s for m in local for s in m["scores"]]
    mean_of = lambda key, rows: _mean([r[key] for r in rows if key in r])  # noqa: E731
    metrics = {
        "policy/reward_mean": _mean(scores),
        "policy/reward_std": float(np.std(scores)),
        "policy/rm_score_mean": _mean([s for m in local for s in m["rm"]]),
        "policy/verifiable_reward_mean": _mean([s for m in local for s in m["verifiable"]]),
        "policy/kl": mean_of("kl", local),
        "policy/response_length": mean_of("response_length", local),
        "rollout/logprob_diff": mean_of("logprob_diff", local),
        "rollout/prob_diff": mean_of("prob_diff", local),
        "policy/kl_coef": kl_coef,
        "policy/tokens_per_s": sum(g.tokens for g in gathered) / max(times),
        "rollout/sync_s": sync_s,
        "policy/entropy": mean_of("entropy", update),
        "policy/clipfrac": mean_of("clipfrac", update),
        "policy/approx_kl": mean_of("approx_kl", update),
        "policy/pg_loss": mean_of("pg_loss", update),
        "policy/grad_norm": update[0].get("grad_norm", math.nan),  # the global norm: the same on every rank
        "policy/nonfinite_skipped": update[0]["nonfinite_skipped"],  # a skip is collective
    }
    if any("ensemble_disagreement" in m for m in local):  # a reward model scored the rollouts
        metrics |= {
            "policy/proxy_score_mean": mean_of("proxy_score_mean", local),
            "policy/shaped_reward_mean": mean_of("shaped_reward_mean", local),
            "policy/ensemble_disagreement": mean_of("ensemble_disagreement", local),
        }
    if any(m.get("audit") for m in local):  # the audit reward model, never trained against
        metrics["policy/audit_score_mean"] = _mean([s for m in local for s in m["audit"]])
    if any("is_weight_mean" in m for m in local):  # pipelined mode
        metrics |= {
            "pipeline/is_weight_mean": mean_of("is_weight_mean", local),
            "pipeline/is_truncated_frac": mean_of("is_truncated_frac", local),
            "pipeline/is_log_ratio_abs": mean_of("is_log_ratio_abs", local),
        }
    if "value_loss" in update[0]:
        metrics |= {
            "policy/value_loss": mean_of("value_loss", update),
            "policy/vf_clipfrac": mean_of("vf_clipfrac", update),
            "policy/explained_variance": mean_of("explained_variance", local),
            "policy/critic_grad_norm": update[0].get("critic_grad_norm", math.nan),
            "policy/critic_nonfinite_skipped": update[0]["critic_nonfinite_skipped"],
        }
    metrics |= timings
    metrics |= {f"policy/step_time_s/worker_{r}": t for r, t in enumerate(times)}
    return {k: float(v) for k, v in metrics.items()}
