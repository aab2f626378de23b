"""One policy-optimisation worker (every rank): a DeepSpeed engine for the actor (and the
critic for PPO), a frozen reference policy and a frozen reward model (plain torch, eval mode;
small enough to replicate at this scale). With `policy.lora` the actor trains adapters only and
the reference is the actor with its adapters off (`rlhf_core.models.lora`): no second copy. Rank 0 also owns the `RolloutEngine` (vLLM), started
once per attempt from the SFT directory and, after a resume, immediately synced to the
checkpoint's actor weights (`policy_rollouts`). One RL step, every phase timed
(`timing/<phase>`):

    generate   rank 0: the step's prompts (`prompt_indices`: a function of the step alone)
               x n samples; scattered to the ranks in whole prompt groups
    score      reward model (an ensemble's members aggregated and shaped:
               `rlhf_core.training.reward_shaping`) + verifiable reward, combined
               (`rlhf_core.training.rewards`); the audit reward model, if any, scores the
               same rollouts for the metrics only; both in the trainer's precision
               (`policy.precision`)
    old_logprobs, ref_logprobs, values, advantages        (`rlhf_core.training.policy_step`)
    update     K epochs of minibatches through DeepSpeed (`update_minibatches`)
    sync       the engine takes the actor's weights in place (`RolloutEngine.sync_weights`):
               streamed from the module itself, one parameter at a time (ZeRO-3: gathered,
               every rank joining; LoRA: merged with its adapters), or, to a file transport
               or a pipeline's producer, as a copy on rank 0 (`policy_weights`)

Pipelined mode (`cfg.pipeline.max_lag > 0`): the generate phase only takes the batch the
producer thread made ready, the sync phase hands the new weights over (the producer applies
them between its chunks), and each token's loss, KL penalty and KL metric are weighted by
min(pi_old / mu, is_cap), the trainer's probability over the sampler's.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlhf_core.algos import AdaptiveKLController, FixedKLController, truncated_is_weights
from rlhf_core.distributed import collectives
from rlhf_core.distributed import deepspeed_engine
from rlhf_core.distributed import policy_rollouts as rollouts
from rlhf_core.distributed import policy_rounds, policy_sync
from rlhf_core.distributed.deepspeed_engine import DeepSpeedBackwardAndStep
from rlhf_core.distributed.fault_injection import fault_point, nan_if_due, worker_point
from rlhf_core.distributed.policy_loop import PolicyWorkerInputs, PolicyWorker
from rlhf_core.distributed.policy_metrics import PolicyRankStep, step_metrics
from rlhf_core.distributed.policy_state import PolicyState, resume, save_checkpoint
from rlhf_core.distributed.stage import agreed_precision, record_attempt, start_worker
from rlhf_core.distributed.worker_meter import WorkerMeter, flatten_workers, peak_rss_gib, synchronise
from rlhf_core.models.llama import load_policy, save_pretrained_atomic
from rlhf_core.models.lora import frozen_reference, load_policy_for_training, reference_view
from rlhf_core.models.placement import frozen_on
from rlhf_core.models.reward import (
    AUDIT_DIR, audit_model_dir, load_reward_model, member_mean, member_stats, normalise, read_reward_meta, score,
    save_reward_model, score_members,
)
from rlhf_core.models.value import value_model_from
from rlhf_core.rng import derive_seed
from rlhf_core.tokenizer import load_tokenizer
from rlhf_core.training.circuit_breaker import Trip, should_trip
from rlhf_core.training.precision import computing_in
from rlhf_core.training.policy_step import (
    PolicyBatch,
    algorithm_spec,
    batched_logprobs,
    batched_values,
    build_batch,
    compute_advantages,
    old_logprobs_from_update,
    prompt_indices,
    rollout_metrics,
    token_rewards,
    update_minibatches,
)
from rlhf_core.training.reward_shaping import proxy_reward
from rlhf_core.training.rewards import mix_rewards
from rlhf_core.training.verifiable import resolve_verifiable_reward, score_verifiable


def train_loop(loop: PolicyWorkerInputs) -> dict[str, Any] | None:
    """The worker function of a policy run; rank 0 returns the run summary."""
    w = _build_worker(loop)
    peaks = {"loaded": peak_rss_gib()}  # rank 0's high-water mark by phase, for the preflight's estimate
    saved = resume(w)
    record_attempt(loop.runtime, w.rank, saved.step if saved is not None else None)
    state = saved if saved is not None else PolicyState()
    w.meter = WorkerMeter(loop.runtime.use_gpu)
    try:
        if w.rank == 0:
            w.engine = rollouts.start_engine(w)
        if saved is not None:  # every rank: under ZeRO-3 the weights are gathered, a collective
            policy_sync.sync_engine(w)
        if w.rank == 0:
            if not state.evaluations:
                state.evaluations.append(rollouts.evaluate(w, 0))
                loop.runtime.emit(0, rollouts.evaluation_metrics(state.evaluations[-1]))
        if w.rank == 0 and w.cfg.pipeline.max_lag > 0 and state.step < w.cfg.steps:
            w.pipeline = rollouts.start_pipeline(w, first_step=state.step + 1)
        while state.step < w.cfg.steps and state.trip is None and w.stopped is None:
            _rl_step(w, state)
        if state.trip is not None:  # every rank saw the same history: all stop here, nothing is saved
            return {**asdict(state), "sync_checks": []} if w.rank == 0 else None
        if w.stopped is not None:  # asked to stop: the step's checkpoint is saved, the weights are not
            return {"stopped": {"step": state.step, "reason": w.stopped}} if w.rank == 0 else None
        peaks["trained"] = peak_rss_gib()
        state_dict = policy_sync.policy_weights(w)
        if w.rank != 0:
            return None
        summary = _finish(w, state, state_dict)
        return {**summary, "peak_memory": peaks | {"saved": peak_rss_gib()}}
    finally:
        try:
            if w.pipeline is not None:
                w.pipeline.close()
        finally:
            if w.engine is not None:
                w.engine.close()


def _build_worker(loop: PolicyWorkerInputs) -> PolicyWorker:
    """Every rank: DeepSpeed engines for the actor (and critic), the frozen reference and
    reward model, the KL controller."""
    cfg = loop.cfg
    # pipelined, the engine's processes generate on the same cores while the ranks train; in step,
    # the engine waits while they train and the ranks share the cores
    worker = start_worker(loop.runtime, cfg.seed, torch_threads=1 if cfg.pipeline.max_lag > 0 else None)
    spec = algorithm_spec(cfg)
    tokenizer = load_tokenizer(loop.sft_dir)
    use_gpu, policy_engine = loop.runtime.use_gpu, deepspeed_engine.policy_engine
    model = load_policy_for_training(loop.sft_dir, cfg.lora, cfg.gradient_checkpointing)
    actor = policy_engine(worker.deepspeed, model, cfg, cfg.learning_rate, use_gpu)
    critic = None
    if spec.uses_critic:
        critic = policy_engine(worker.deepspeed, value_model_from(loop.sft_dir), cfg, cfg.ppo.critic_learning_rate, use_gpu)
    # with LoRA the reference is the actor with its adapters off (`reference_view`): no copy
    device = actor.device
    reference = frozen_reference(loop.sft_dir, cfg.lora, device)
    reward_model = rm_stats = reward_tokenizer = audit = None
    members: tuple = ()
    if loop.reward_dir is not None:
        reward_model, reward_tokenizer, rm_stats = load_reward_model(loop.reward_dir)
        # fp32 with preference rounds, which train it further on rank 0; else frozen like the reference
        reward_model = (reward_model.to(device).requires_grad_(False) if cfg.rounds.enabled
                        else frozen_on(reward_model, device))
        members = member_stats(read_reward_meta(loop.reward_dir))
        if (audit_dir := audit_model_dir(loop.reward_dir)) is not None:
            audit_model, audit_tokenizer, audit_stats = load_reward_model(audit_dir)
            audit = (frozen_on(audit_model, device), audit_tokenizer, audit_stats)
    kl_controller = (
        FixedKLController(cfg.kl_coef)
        if cfg.adaptive_kl_target is None
        else AdaptiveKLController(cfg.kl_coef, cfg.adaptive_kl_target, cfg.adaptive_kl_horizon)
    )
    verifiable = resolve_verifiable_reward(cfg.verifiable_reward) if loop.prompts_verifiable else None
    w = PolicyWorker(loop, spec, tokenizer, actor, critic, reference, reward_model, rm_stats, verifiable,
                     kl_controller, worker.rank, worker.world, reward_tokenizer=reward_tokenizer,
                     member_stats=members, audit=audit)
    if worker.rank == 0 and cfg.rounds.enabled and reward_model is not None:
        w.annotator = policy_rounds.annotator_for(w)
    w.precision = agreed_precision("policy", cfg.precision, loop.runtime.use_gpu, worker)
    return w


@contextmanager
def _timed(timings: dict[str, float], phase: str):
    """The phase's wall time; on a GPU worker from a CUDA synchronisation to another, so that
    it times the phase's kernels, not their launches."""
    on_gpu = torch.cuda.is_initialized()
    synchronise(on_gpu)
    start = time.perf_counter()
    yield
    synchronise(on_gpu)
    timings[f"timing/{phase}"] = time.perf_counter() - start


ENGINE_FIGURES = ("rollout/gen_s", "rollout/gen_tokens", "rollout/tokens_per_s", "rollout/sleep_s", "rollout/wake_s")


def _rl_step(w: PolicyWorker, state: PolicyState) -> None:
    cfg, rank = w.cfg, w.rank
    step = state.step + 1  # 1-based number of the step being run
    timings: dict[str, float] = {}
    start = time.perf_counter()
    w.meter.start()

    pipeline_metrics: dict[str, float] = {}
    with _timed(timings, "generate"):  # pipelined: the time the trainer waited for the batch
        indices = prompt_indices(len(w.loop.prompts), cfg.prompts_per_step, state.step, cfg.seed)
        shards, check = None, None
        if rank == 0 and w.pipeline is not None:
            shards, pipeline_metrics = rollouts.take_pipelined(w, step)
        elif rank == 0:
            shards = rollouts.generate(w, indices, step)
            check = policy_sync.verification(w, step, shards[0])  # before the release: at step 1 the engine's SFT figures
            w.engine.release()  # with policy.rollout.sleep its GPU memory is the trainer's until the sync
        received: list[Any] = [None]
        dist.scatter_object_list(received, shards, src=0)
        samples: list[rollouts.Sample] = received[0]
    check = policy_sync.shared(check) if policy_sync.verifies(w) else None  # None on every rank when rank 0 has none
    if check is not None and step == 1:  # the trainer's figures before its first update
        check.trainer_before = policy_sync.trainer_logprobs(w, check.probe)

    batch = build_batch(samples, w.tokenizer.pad_token_id).to(w.device)
    with w.meter.compute():  # this worker's own forward passes, no collectives: its throughput
        with _timed(timings, "score"), computing_in(w.precision, w.actor.device):  # frozen scorers: the same
            local = _score(w, samples, batch, state)
        with computing_in(w.precision, w.actor.device):  # the trainer's passes: fp32 or bf16 autocast
            with _timed(timings, "old_logprobs"):  # else the update's own forward gives them
                if not old_logprobs_from_update(w.spec, cfg):
                    batch.old_logprobs = batched_logprobs(w.actor.module, batch, cfg.temperature, cfg.micro_batch_size)
                if cfg.pipeline.max_lag > 0:  # correct for the sampler's lag behind these weights
                    batch.is_weights, is_metrics = truncated_is_weights(
                        batch.old_logprobs, batch.engine_logprobs, batch.response_mask, cfg.pipeline.is_cap
                    )
                    local |= is_metrics
            with _timed(timings, "ref_logprobs"):
                with reference_view(w.actor, w.reference) as reference:
                    batch.ref_logprobs = batched_logprobs(reference, batch, cfg.temperature, cfg.micro_batch_size)
            with _timed(timings, "values"):
                if w.critic is not None:
                    batch.values = batched_values(w.critic.module, batch, cfg.micro_batch_size)
    kl_coef = w.kl_controller.value
    with _timed(timings, "advantages"):
        rewards, _ = token_rewards(batch, w.spec, kl_coef, cfg.kl_estimator)
        batch.advantages, batch.returns = compute_advantages(batch, rewards, w.spec, cfg)

    with _timed(timings, "update"), computing_in(w.precision, w.actor.device):
        update = update_minibatches(
            w.actor, batch, w.spec, cfg, nan_if_due(DeepSpeedBackwardAndStep(w.actor), worker_point("policy", step, rank)),
            minibatch_size=cfg.minibatch_size // w.world, kl_coef=kl_coef,
            critic=w.critic, critic_step=DeepSpeedBackwardAndStep(w.critic) if w.critic is not None else None,
            generator=torch.Generator().manual_seed(derive_seed(cfg.seed, step, rank=rank, world=w.world)),
        )
    local |= rollout_metrics(batch)  # the batch as sampled, before the update (old_logprobs are pi_old's)

    with _timed(timings, "sync"):  # pipelined: gather and hand over; the producer applies it
        sync_s, state_dict = policy_sync.sync(w, step)
    verified, failed = {}, None
    if check is not None:
        verified, failed = check.run(w, policy_sync.verify_bound(w), lambda: policy_sync.sync(w, step))

    gathered: list[Any] = [None] * w.world
    dist.all_gather_object(gathered, PolicyRankStep(time.perf_counter() - start, local, update,
                                                    int(batch.attention_mask.sum()), w.meter.figures(len(samples))))
    metrics = step_metrics(gathered, timings, kl_coef, sync_s) | pipeline_metrics | verified
    if rank == 0 and w.pipeline is None:  # the engine's own: generation tokens/s, its sleep and wake
        metrics |= {k: v for k, v in w.engine.last_metrics.items() if k in ENGINE_FIGURES}
    _end_step(w, state, step, indices, metrics, state_dict, [g.worker for g in gathered], failed)


def _end_step(w: PolicyWorker, state: PolicyState, step: int, indices: list[int], metrics: dict[str, float],
              state_dict: dict[str, torch.Tensor] | None, workers: list[dict[str, Any]],
              sync_failed: str | None = None) -> None:
    """Every rank: the KL controller, the run's state, rank 0's evaluations, the circuit
    breaker, the metrics out, and the checkpoint when one is due."""
    cfg, rank = w.cfg, w.rank
    w.kl_controller.update(metrics["policy/kl"], cfg.rollouts_per_step)
    metrics["policy/kl_coef_next"] = w.kl_controller.value

    state.step = step
    state.kl_final = metrics["policy/kl"]
    state.kl_max = max(state.kl_max, metrics["policy/kl"])
    state.nonfinite_skipped += int(metrics["policy/nonfinite_skipped"] + metrics.get("policy/critic_nonfinite_skipped", 0))
    state.consumed.append(indices)
    state.kl_controller = w.kl_controller.state_dict()
    # an engine the sync did not reach (asleep on a GPU, or holding other weights) answers nothing
    # about this policy: the step trips the breaker below, unevaluated
    if rank == 0 and sync_failed is None:
        if policy_sync.check_due(w, step):
            with rollouts.engine_at_newest(w):
                w.sync_checks.append(rollouts.sync_check(w, state_dict, step))
        if step % cfg.eval_every == 0 or step == cfg.steps:
            with rollouts.engine_at_newest(w):
                evaluation = rollouts.evaluate(w, step)
            state.evaluations.append(evaluation)
            metrics |= rollouts.evaluation_metrics(evaluation)
    if sync_failed is None and policy_rounds.due(w, step):
        metrics |= policy_rounds.run_round(w, state, step)
    drift_bound = policy_sync.verify_bound(w)
    if drift_bound is not None and cfg.circuit_breaker.enabled:
        metrics["rollout/prob_diff_bound"] = drift_bound  # for the alert (Prometheus) beside the figure
    trip = Trip("sync_failed", sync_failed, step) if sync_failed is not None else \
        should_trip([*state.history, {"step": step, **metrics}], cfg.circuit_breaker, cfg.kl_bound, drift_bound)
    if trip is not None:
        state.trip = {"reason": trip.reason, "message": trip.message, "step": trip.step}
        metrics["policy/circuit_breaker_tripped"] = 1.0
    state.history.append({"step": step, **metrics})
    if rank == 0:
        w.loop.runtime.emit(step, metrics | flatten_workers(workers))
    if trip is not None:
        return  # no checkpoint of this step: the last one reported is the last good one

    fault_point(worker_point("policy", step, rank))
    stop = w.loop.runtime.agreed_stop(rank) if step < cfg.steps else None
    if stop is not None or step % cfg.checkpoint_every == 0 or step == cfg.steps:
        save_checkpoint(w, state, metrics)  # the only ray.train.report: see rlhf_core.distributed.stage
    w.stopped = stop


def _score(w: PolicyWorker, samples: list[rollouts.Sample], batch: PolicyBatch, state: PolicyState) -> dict[str, Any]:
    """Fill batch.scores; -> this rank's raw per-sample reward terms for the step metrics."""
    cfg = w.cfg
    prompts, responses = [s.prompt for s in samples], [s.response_text for s in samples]
    rm_reward = verifiable = None
    out: dict[str, Any] = {"rm": [], "verifiable": [], "audit": []}
    if w.reward_model is not None:
        raw = score_members(w.reward_model, w.reward_tokenizer, prompts, responses, max_length=w.max_length)  # (K, B)
        lengths = batch.response_mask.sum(-1).cpu()  # (B,) response tokens, beside the scores (CPU)
        if state.reference_score is None:  # the first step samples the SFT policy: the reference
            _measure_reference(w, state, raw, lengths, list(zip(prompts, responses)))
        rm_reward, shaping = proxy_reward(raw, [m.mean for m in w.member_stats], [m.std for m in w.member_stats],
                                          lengths, cfg.shaping, state.reference_score, state.reference_length)
        out |= shaping
        out["rm"] = normalise(member_mean(raw), w.rm_stats).tolist()
    if w.audit is not None:
        audit_model, audit_tokenizer, audit_stats = w.audit
        out["audit"] = normalise(score(audit_model, audit_tokenizer, prompts, responses, max_length=w.max_length),
                                 audit_stats).tolist()
    if w.verifiable is not None:
        verifiable = score_verifiable(w.verifiable, prompts, responses, dict(w.loop.answers))
        out["verifiable"] = verifiable.tolist()
    batch.scores = mix_rewards(rm_reward, verifiable, cfg.reward_model_weight, cfg.verifiable_reward_weight
                               ).to(batch.response_mask.device)
    out["scores"] = batch.scores.tolist()
    return out


def _measure_reference(w: PolicyWorker, state: PolicyState, raw: torch.Tensor, lengths: torch.Tensor,
                       samples: list[tuple[str, str]]) -> None:
    """Every rank (collectives): the mean aggregated score and length of the first step's
    rollouts over all ranks, and (with preference rounds, which change the reward model) the
    rollouts themselves, into `state` (checkpointed with it)."""
    aggregated = policy_rounds.aggregated_score(w, raw)
    totals = torch.tensor([aggregated.double().sum().item(), lengths.double().sum().item(), float(len(lengths))],
                          dtype=torch.float64)  # host-side figures: reduced over a group that serves the CPU
    collectives.all_reduce(totals, collectives.host_group(), "the reference measurement")
    state.reference_score = float(totals[0] / totals[2])
    state.reference_length = float(totals[1] / totals[2])
    if w.cfg.rounds.enabled:
        gathered: list[Any] = [None] * w.world
        dist.all_gather_object(gathered, [list(s) for s in samples])
        state.reference_samples = [s for shard in gathered for s in shard]


def _finish(w: PolicyWorker, state: PolicyState, state_dict: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Rank 0: save the policy in HF format; -> the run summary."""
    model = load_policy(w.loop.sft_dir)
    model.load_state_dict(state_dict)
    meta = {
        "stage": "policy",
        "algorithm": w.cfg.algorithm,
        "base_model": w.loop.sft_dir,
        "reward_model": w.loop.reward_dir,
        "steps": state.step,
        "accuracy_before": state.evaluations[0].get("eval/accuracy"),
        "accuracy_after": state.evaluations[-1].get("eval/accuracy"),
        "kl_max": state.kl_max,
        "kl_bound": w.cfg.kl_bound,
        "precision": w.precision,
    }
    dtype = deepspeed_engine.saved_dtype(w.loop.runtime.use_gpu)
    save_pretrained_atomic(model, w.tokenizer, Path(w.loop.out_dir), extra=meta, dtype=dtype)
    if state.audit_pairs:  # the audit the rounds kept current judges this policy at the gates
        audit_model, audit_tokenizer, audit_stats = w.audit
        save_reward_model(audit_model, audit_tokenizer, Path(w.loop.out_dir) / AUDIT_DIR, audit_stats,
                          extra={"round_pairs": len(state.audit_pairs)}, dtype=dtype)
    return {**asdict(state), "sync_checks": w.sync_checks}
