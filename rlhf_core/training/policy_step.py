"""One PPO / GRPO step as a visible sequence of named phases over tensors.

    rollouts ─► build_batch (policy_batch.py) ─► (score: rewards.py) ─► policy_logprobs (old, ref) ─► token_values
             ─► token_rewards ─► compute_advantages ─► update_minibatches ─► (sync weights)

Pure torch: no Ray, DeepSpeed or vLLM. The distributed trainer
(`rlhf_core.distributed.policy_trainer`) calls these in order on each worker's share of the
rollouts; the tests call them with a tiny model and a plain torch optimizer.

Shapes: B sequences, L = prompt + response tokens (right padded), T response tokens, V vocab.

The two algorithms differ only in data, never in code paths (`ALGORITHMS`):

    ppo   GAE over token rewards = -beta * KL on every token + reward on the last one; critic;
          advantages whitened over the worker's batch; PPO-clip loss.
    grpo  one outcome reward per response, advantage = (r - group mean) / group std; no critic;
          the KL penalty (beta * k) is in the loss, not in the reward (DeepSeekMath eq. 3).

Departures, on purpose:
- "Old" logprobs are the trainer's recompute at the sampling temperature, not the engine's
  (`rollout/logprob_diff` measures the gap, ~1e-7 in fp32); logits are divided by the
  temperature in every phase, as in verl.
- Minibatch losses are normalised per worker (token or sequence count of this worker's
  minibatch); DeepSpeed then averages the workers' gradients. With equal-length answers this is
  the global token mean; in general it is the mean of per-worker means (verl does the same).
- Non-finite guard: a micro-batch whose loss is not finite has it multiplied by NaN before
  backward, so every gradient of its minibatch is NaN, and the optimizer step at the boundary
  is skipped (`TorchBackwardAndStep` here; DeepSpeed ZeRO's invalid-grad-norm skip in the
  trainer). Poisoning instead of not calling backward keeps every worker's collectives in step.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from rlhf_core.algos import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    KL_ESTIMATORS,
    Registry,
    aggregate_loss,
    entropy_from_logits,
    explained_variance,
    kl_penalized_rewards,
    logprobs_from_logits,
    loss_normalizer,
    masked_mean,
    masked_sum,
    score_on_last_token,
    value_loss,
    whiten,
)
from rlhf_core.config import PolicyConfig
from rlhf_core.models.logits import logits_from
from rlhf_core.training.policy_batch import (  # noqa: F401 - the batch's API, also imported from here
    PolicyBatch, RolloutLike, build_batch, prompt_indices,
)

# ----------------------------------------------------------------------------- algorithms


@dataclass(frozen=True)
class AlgorithmSpec:
    """What distinguishes PPO from GRPO, as data: registry keys and switches."""

    advantage: str  # key of ADVANTAGE_ESTIMATORS
    loss: str  # key of POLICY_LOSSES
    kl_in_reward: bool  # True: -beta * KL in the token rewards; False: beta * KL in the loss
    uses_critic: bool
    whiten_advantages: bool


ALGORITHMS = Registry("policy algorithm")  # name -> fn(PolicyConfig) -> AlgorithmSpec


@ALGORITHMS.register("ppo")
def _ppo(cfg: PolicyConfig) -> AlgorithmSpec:
    return AlgorithmSpec("gae", "ppo", kl_in_reward=True, uses_critic=True, whiten_advantages=cfg.ppo.whiten_advantages)


@ALGORITHMS.register("grpo")
def _grpo(cfg: PolicyConfig) -> AlgorithmSpec:
    estimator = "grpo" if cfg.grpo.scale_by_std else "grpo_no_std"
    return AlgorithmSpec(estimator, "grpo", kl_in_reward=False, uses_critic=False, whiten_advantages=False)


def algorithm_spec(cfg: PolicyConfig) -> AlgorithmSpec:
    return ALGORITHMS[cfg.algorithm](cfg)


# ----------------------------------------------------------------------------- forward passes


def _response_logits(model, batch: PolicyBatch, temperature: float) -> torch.Tensor:
    """Logits / temperature at the positions that predict the response tokens. -> (B, T, V).
    The head runs from the first such column on (`rlhf_core.models.logits`): the prompts'
    logits, and their gradients, are never made."""
    logits, offset = logits_from(model, batch.input_ids, batch.attention_mask, int(batch.positions.min()))
    index = (batch.positions - offset).unsqueeze(-1).expand(-1, -1, logits.shape[-1])  # (B, T, V)
    return logits.gather(1, index) / temperature


def policy_logprobs(
    model, batch: PolicyBatch, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_t | x, y_<t) at `temperature` (B, T), and the entropy of that distribution
    (B, T) when asked. Differentiable; wrap in no_grad for old / reference logprobs."""
    logits = _response_logits(model, batch, temperature)  # (B, T, V)
    logprobs = logprobs_from_logits(logits, batch.response_ids)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return logprobs, entropy


@torch.no_grad()
def batched_logprobs(model, batch: PolicyBatch, temperature: float, chunk: int) -> torch.Tensor:
    """`policy_logprobs` in eval mode over chunks of `chunk` rows. -> (B, T)."""
    was_training = model.training
    model.eval()
    try:
        return torch.cat([policy_logprobs(model, part, temperature)[0] for part in _chunks(batch, chunk)])
    finally:
        model.train(was_training)


def teacher_forced(model, rows, pad_id: int, precision: str, device: torch.device, chunk: int) -> list[torch.Tensor]:
    """Per row (each with `prompt_token_ids` and `response_token_ids`), the log-probs at
    temperature 1 `model` gives its response tokens, as a step's old log-probs are computed: in
    `precision` (autocast) on `device`, `chunk` rows a pass; fp32 on the CPU. What the check after
    a weight sync compares with the engine's (`rlhf_core.rollout.sync_check`)."""
    from rlhf_core.training.precision import computing_in  # noqa: PLC0415

    batch = build_batch(rows, pad_id).to(device)
    with computing_in(precision, device):
        logprobs = batched_logprobs(model, batch, 1.0, chunk).float().cpu()
    return [logprobs[i, : len(r.response_token_ids)] for i, r in enumerate(rows)]


def token_values(critic, batch: PolicyBatch) -> torch.Tensor:
    """V of the state before each response token (same columns as the logprobs). -> (B, T)."""
    values = critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask)[:, :-1]  # (B, L-1)
    return values.gather(1, batch.positions).float()  # fp32 for GAE and the value loss, also under bf16 autocast


@torch.no_grad()
def batched_values(critic, batch: PolicyBatch, chunk: int) -> torch.Tensor:
    was_training = critic.training
    critic.eval()
    try:
        return torch.cat([token_values(critic, part) for part in _chunks(batch, chunk)])
    finally:
        critic.train(was_training)


def _chunks(batch: PolicyBatch, size: int) -> Iterable[PolicyBatch]:
    for start in range(0, len(batch), size):
        yield batch.select(torch.arange(start, min(start + size, len(batch))))


# ----------------------------------------------------------------------------- rewards, advantages


def k3_sequence_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-sequence KL(pi || ref) estimate: sum over response tokens of k3 (unbiased, >= 0),
    each weighted by `weights` (pi / mu) when the tokens were sampled from another policy mu.
    -> (B,)."""
    k3 = KL_ESTIMATORS["k3"](logprobs, ref_logprobs)
    return masked_sum(k3 if weights is None else weights * k3, mask, dim=-1)


def token_rewards(
    batch: PolicyBatch, spec: AlgorithmSpec, kl_coef: float, kl_estimator: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token rewards (B, T): the sequence score on the last token, minus beta * KL on every
    token when the algorithm puts the KL in the reward (PPO; GRPO keeps it in the loss, and
    needs no logprobs here), importance-weighted when the batch has is_weights (pipelined
    rollouts)."""
    if not spec.kl_in_reward:
        return score_on_last_token(batch.scores, batch.response_mask), {"score_mean": batch.scores.mean().item()}
    return kl_penalized_rewards(
        batch.scores, batch.old_logprobs, batch.ref_logprobs, batch.response_mask, kl_coef, kl_estimator,
        kl_weights=batch.is_weights,
    )


def compute_advantages(
    batch: PolicyBatch, rewards: torch.Tensor, spec: AlgorithmSpec, cfg: PolicyConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns (B, T) through `ADVANTAGE_ESTIMATORS[spec.advantage]`."""
    advantages, returns = ADVANTAGE_ESTIMATORS[spec.advantage](
        rewards, batch.response_mask, values=batch.values, group_ids=batch.group_ids,
        gamma=cfg.ppo.gamma, lam=cfg.ppo.lam,
    )
    if spec.whiten_advantages:
        advantages = whiten(advantages, batch.response_mask)
    return advantages, returns


# ----------------------------------------------------------------------------- update


@dataclass(frozen=True)
class StepOutcome:
    applied: bool  # False: the step was skipped (non-finite gradients)
    grad_norm: float  # before clipping; inf / NaN when skipped


# (loss of one micro-batch, is it the last of its minibatch) -> StepOutcome at the boundary, else None
BackwardAndStep = Callable[[torch.Tensor, bool], "StepOutcome | None"]


class TorchBackwardAndStep:
    """The plain-torch `BackwardAndStep`: accumulate gradients; at the minibatch boundary clip
    them to `max_grad_norm` and step, unless the loss or any gradient is non-finite, in which
    case the gradients are dropped and the step is skipped."""

    def __init__(self, params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer, max_grad_norm: float):
        self.params = [p for p in params if p.requires_grad]
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm

    def __call__(self, loss: torch.Tensor, boundary: bool) -> StepOutcome | None:
        guard_nonfinite(loss).backward()
        if not boundary:
            return None
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        applied = math.isfinite(norm)
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutcome(applied, norm)


def guard_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """The loss itself if finite, else loss * NaN: backward then makes every gradient NaN, so the
    minibatch's optimizer step is skipped whatever the optimizer (see the module docstring)."""
    return loss if bool(torch.isfinite(loss)) else loss * float("nan")


class _Mean:
    """Running means of named floats (NaN values are skipped)."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            if math.isfinite(v):
                self.sums[k] = self.sums.get(k, 0.0) + v
                self.counts[k] = self.counts.get(k, 0) + 1

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / self.counts[k] for k in self.sums}


def old_logprobs_from_update(spec: AlgorithmSpec, cfg: PolicyConfig) -> bool:
    """Whether a step can take pi_old's logprobs from its update's own forward pass instead of
    a forward pass of their own: when the rollouts get exactly one optimizer update (one epoch,
    one minibatch), that update differentiates pi_old itself, and nothing needs pi_old before
    it: no KL in the reward (PPO puts it there) and no lag correction (pipelined mode). The
    ratio is then exp(logp - logp.detach()) = 1 with the policy gradient as its gradient, as in
    TRL's GRPO with num_iterations=1. It saves one forward pass over the batch per step."""
    return (
        cfg.epochs_per_step == 1
        and cfg.minibatch_size == cfg.rollouts_per_step
        and not spec.kl_in_reward
        and cfg.pipeline.max_lag == 0
    )


def update_minibatches(
    actor: torch.nn.Module,
    batch: PolicyBatch,
    spec: AlgorithmSpec,
    cfg: PolicyConfig,
    actor_step: BackwardAndStep,
    *,
    minibatch_size: int,
    kl_coef: float,
    critic: torch.nn.Module | None = None,
    critic_step: BackwardAndStep | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """`cfg.epochs_per_step` passes over `batch` in shuffled minibatches of `minibatch_size`
    rows (this worker's share), each one optimizer step accumulated over micro-batches of
    `cfg.micro_batch_size` rows. The critic, if any, is updated on the same minibatches.

    batch needs old_logprobs, advantages (+ ref_logprobs for a KL in the loss, values and
    returns for the critic; is_weights, if set, weigh each token's policy loss). Without
    old_logprobs, the update must be a single pass in a single minibatch
    (`old_logprobs_from_update`): they are then taken, detached, from its forward pass and
    stored in batch.old_logprobs for the step's diagnostics.
    -> flat metrics without stage prefix: pg_loss, clipfrac,
    approx_kl, entropy, grad_norm, nonfinite_skipped (+ value_loss, vf_clipfrac,
    explained_variance, critic_grad_norm, critic_nonfinite_skipped with a critic).
    """
    if spec.uses_critic and (critic is None or critic_step is None):
        raise ValueError(f"{cfg.algorithm} needs a critic and its optimizer step")
    actor.train()
    if critic is not None:
        critic.train()
    kl_kwargs = (
        {} if spec.kl_in_reward else {"ref_logprobs": None, "kl_coef": kl_coef, "kl_estimator": cfg.kl_estimator}
    )
    fill_old = batch.old_logprobs is None
    if fill_old and (cfg.epochs_per_step != 1 or minibatch_size < len(batch)):
        raise ValueError(
            f"update_minibatches: batch has no old_logprobs, which only a single on-policy update may take from "
            f"its own forward pass; this one makes {cfg.epochs_per_step} pass(es) in minibatches of "
            f"{minibatch_size} over {len(batch)} rows"
        )
    old_logprobs = torch.zeros_like(batch.response_mask) if fill_old else None
    means, counts = _Mean(), {"nonfinite_skipped": 0, "critic_nonfinite_skipped": 0}
    for _epoch in range(cfg.epochs_per_step):
        order = torch.randperm(len(batch), generator=generator)
        for mb_index in order.split(minibatch_size):
            minibatch = batch.select(mb_index)
            normalizer = loss_normalizer(minibatch.response_mask, cfg.loss_agg)
            rows = mb_index.split(cfg.micro_batch_size)
            micro_batches = list(_chunks(minibatch, cfg.micro_batch_size))
            for i, micro in enumerate(micro_batches):
                boundary = i == len(micro_batches) - 1
                metrics, logprobs = _actor_micro_step(
                    actor, micro, spec, cfg, actor_step, normalizer, kl_kwargs, boundary, counts
                )
                if fill_old:
                    old_logprobs[rows[i]] = logprobs
                if spec.uses_critic:
                    metrics |= _critic_micro_step(critic, micro, cfg, critic_step, normalizer, boundary, counts)
                means.add(metrics)
    if fill_old:
        batch.old_logprobs = old_logprobs
    return {**means.means(), **{k: float(v) for k, v in counts.items()}}


def _actor_micro_step(
    actor, micro, spec, cfg, step, normalizer, kl_kwargs, boundary, counts
) -> tuple[dict[str, float], torch.Tensor]:
    """One micro-batch's policy loss, backward and (at the boundary) optimizer step.
    -> its metrics, and its logprobs before the step, detached."""
    mask = micro.response_mask
    logprobs, entropy = policy_logprobs(actor, micro, cfg.temperature, with_entropy=True)
    old_logprobs = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
    if kl_kwargs:
        kl_kwargs = {**kl_kwargs, "ref_logprobs": micro.ref_logprobs}
    pg_loss, metrics = POLICY_LOSSES[spec.loss](
        logprobs, old_logprobs, micro.advantages, mask,
        clip_range=cfg.clip_range, agg=cfg.loss_agg, normalizer=normalizer, is_weights=micro.is_weights, **kl_kwargs,
    )
    loss = pg_loss
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * aggregate_loss(entropy, mask, cfg.loss_agg, normalizer)
    outcome = step(guard_nonfinite(loss), boundary)
    metrics = {**metrics, "pg_loss": pg_loss.item(), "entropy": masked_mean(entropy.detach(), mask).item()}
    if outcome is not None:
        counts["nonfinite_skipped"] += not outcome.applied
        metrics["grad_norm"] = outcome.grad_norm
    return metrics, logprobs.detach()


def _critic_micro_step(critic, micro, cfg, step, normalizer, boundary, counts) -> dict[str, float]:
    values = token_values(critic, micro)
    loss, metrics = value_loss(
        values, micro.values, micro.returns, micro.response_mask,
        clip_range_value=cfg.ppo.clip_range_value, agg=cfg.loss_agg, normalizer=normalizer,
    )
    outcome = step(guard_nonfinite(cfg.ppo.vf_coef * loss), boundary)
    metrics = {"value_loss": loss.item(), "vf_clipfrac": metrics["vf_clipfrac"]}
    if outcome is not None:
        counts["critic_nonfinite_skipped"] += not outcome.applied
        metrics["critic_grad_norm"] = outcome.grad_norm
    return metrics


def rollout_metrics(batch: PolicyBatch) -> dict[str, float]:
    """Diagnostics of a filled batch before the update (no stage prefix)."""
    mask = batch.response_mask
    metrics = {
        "logprob_diff": masked_mean((batch.engine_logprobs - batch.old_logprobs).abs(), mask).item(),
        # verl's rollout_probs_diff_mean: below 0.005 healthy, above 0.01 a precision or sync problem
        "prob_diff": masked_mean((batch.engine_logprobs.exp() - batch.old_logprobs.exp()).abs(), mask).item(),
        "kl": k3_sequence_kl(batch.old_logprobs, batch.ref_logprobs, mask, batch.is_weights).mean().item(),
        "response_length": mask.sum(-1).float().mean().item(),
    }
    if batch.values is not None and batch.returns is not None:
        metrics["explained_variance"] = explained_variance(batch.values, batch.returns, mask)
    return metrics
