"""Policy optimisation (PPO | GRPO) on Ray Train + DeepSpeed, with rollouts from a vLLM engine
that follows the trainer's weights; resumable after a lost worker.

Driver, `train_policy`: checks the input before anything starts (no prompts, eval prompts
without answers, a reward weight with nothing to compute it, a head size vLLM's CPU backend
cannot run, more workers than the Ray cluster has CPUs/GPUs), then runs the workers
(`rlhf_core.distributed.stage.fit_stage`) and reads their summary.

The rest lives by job:

    policy_worker    every rank's loop: engines, one RL step phase by phase, the circuit breaker
    policy_rollouts  rank 0: the vLLM engine's rollouts (synchronous or pipelined) and evaluations
    policy_state     where the run stands, and its checkpoint
    policy_loop      what a worker is given (`PolicyWorkerInputs`) and holds (`PolicyWorker`)
    policy_metrics   the flat metrics of one step

Held-out exact-match accuracy (greedy, through the engine) and the mean normalised reward-model
score of those answers are measured before training, every `eval_every` steps and at the end.
Only checkpoint steps call `ray.train.report`; per-step metrics go to the picklable
`on_metrics` on rank 0 (see `rlhf_core.distributed.stage`).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_core.config import PolicyConfig, ValidationConfig
from rlhf_core.distributed.policy_loop import PolicyWorkerInputs
from rlhf_core.distributed.policy_worker import train_loop
from rlhf_core.distributed.stage import StageRecord, StageRuntime, fit_stage
from rlhf_core.models.pretrained import VLLM_CPU_HEAD_SIZES
from rlhf_core.models.reward import audit_model_dir
from rlhf_core.training.stage_types import StageFailed, StageSite, StageStopped
from rlhf_core.training.circuit_breaker import CircuitBreakerTripped, Trip
from rlhf_core.training.verifiable import resolve_verifiable_reward, score_verifiable


@dataclass(frozen=True)
class PolicyTrainResult:
    path: Path  # HF directory of the trained policy
    algorithm: str
    accuracy_before: float | None  # held-out exact match, greedy through the engine; None: no answers
    accuracy_after: float | None
    # per-sequence KL(pi || ref) of the last step's rollouts (dpo, kto: answers sampled on the held-out prompts)
    kl_final: float
    kl_max: float  # largest over the run
    kl_bound: float  # cfg.kl_bound, for the gates
    steps: int
    run: StageRecord  # attempts, seconds, checkpoint; per step the rows consumed and the metrics
    evaluations: list[dict[str, float]] = field(repr=False, default_factory=list)  # {step, eval/...}
    # rank 0's largest resident memory (GiB) by the end of each phase: loaded, trained, then
    # evaluated (dpo, kto: the held-out figures after training) or saved (ppo, grpo)
    peak_memory: dict[str, float] = field(repr=False, default_factory=dict)
    # ppo and grpo only (rollouts scored by a reward model); dpo and kto leave the defaults
    rm_score_before: float | None = None  # mean normalised RM score of the greedy eval answers
    rm_score_after: float | None = None
    audit_score_before: float | None = None  # the same answers under the audit reward model; None without one
    audit_score_after: float | None = None
    audit_dir: Path | None = None  # the audit model preference rounds kept current, saved with the policy
    labels_asked: int = 0  # labels the preference rounds asked for (their cost); 0 without rounds
    round_pairs: int = 0  # pairs the rounds added to the reward model's training
    nonfinite_skipped: int = 0  # optimizer steps skipped for non-finite loss / gradients (actor + critic)
    sync_checks: list[dict[str, Any]] = field(repr=False, default_factory=list)  # policy.rollout.check_sync

    @property
    def accuracy_gain(self) -> float | None:
        if self.accuracy_before is None or self.accuracy_after is None:
            return None
        return self.accuracy_after - self.accuracy_before


def train_policy(
    prompts: Sequence[str],
    eval_prompts: Sequence[str],
    eval_answers: Sequence[str],
    sft_dir: Path,
    reward_dir: Path | None,
    cfg: PolicyConfig,
    site: StageSite,
    *,
    answers: Mapping[str, str] | None = None,
    replay_pairs: Sequence[Mapping[str, str]] = (),
    queue_dir: Path | None = None,
    validation: ValidationConfig | None = None,
    answer_checker: str | None = None,
) -> PolicyTrainResult:
    """Optimise the SFT policy in `sft_dir` on `prompts` with `cfg.algorithm`, rewarded by the
    reward model in `reward_dir` and/or the verifiable reward `cfg.verifiable_reward`, and
    save it to `site.out_dir`, reporting `policy/...` metrics (`StageSite`: where it runs and
    reports). `answers` (prompt -> answer, from the prompt set) feed a verifiable
    reward that checks against them (`rlhf_core.training.verifiable.answer_exact_match`).
    With `cfg.rounds` on, preference rounds replay `replay_pairs` (the reward model's training
    pairs), pass new pairs through the `validation` contract and, for the queue annotator,
    use `queue_dir` (default: `site.out_dir`'s sibling `labelling-queue`). Held-out accuracy judges
    `eval_answers` with `answer_checker` (`data.answer_checker`; None: the exact text).
    Raises `StageStopped` when asked to stop (`site.stop_requested`), after a checkpoint of its
    last step, and `StageFailed` (after saving) when the held-out accuracy gain is below
    `cfg.min_accuracy_gain`.
    """
    answers = dict(answers or {})
    prompts_verifiable = _check_inputs(prompts, eval_prompts, eval_answers, sft_dir, reward_dir, cfg, answers)

    def loop_for(runtime: StageRuntime) -> PolicyWorkerInputs:
        return PolicyWorkerInputs(
            runtime, cfg, sft_dir=str(Path(sft_dir).resolve()),
            reward_dir=str(Path(reward_dir).resolve()) if reward_dir is not None else None,
            out_dir=str(Path(site.out_dir).resolve()), prompts=tuple(prompts), eval_prompts=tuple(eval_prompts),
            eval_answers=tuple(eval_answers), prompts_verifiable=prompts_verifiable,
            answers=tuple(answers.items()),
            replay_pairs=tuple({k: r[k] for k in ("prompt", "chosen", "rejected")} for r in replay_pairs),
            queue_dir=str(Path(queue_dir or cfg.rounds.queue_dir or Path(site.out_dir).parent / "labelling-queue").resolve()),
            validation=validation or ValidationConfig(), answer_checker=answer_checker,
        )

    run = fit_stage("policy", loop_for, train_loop, cfg, site)
    summary = run.summary
    if summary.get("trip") is not None:
        raise CircuitBreakerTripped(Trip(**summary["trip"]), run.checkpoint_path)
    if summary.get("stopped") is not None:
        raise StageStopped("policy", summary["stopped"]["step"], summary["stopped"]["reason"], run.checkpoint_path)
    out = _result(run, cfg, Path(site.out_dir))
    if out.accuracy_gain is not None and out.accuracy_gain < cfg.min_accuracy_gain:
        raise StageFailed(
            f"policy: held-out accuracy {out.accuracy_before:.3f} -> {out.accuracy_after:.3f} "
            f"(gain {out.accuracy_gain:+.3f}) is below policy.min_accuracy_gain={cfg.min_accuracy_gain}"
        )
    return out


def _result(run, cfg: PolicyConfig, out_dir: Path) -> PolicyTrainResult:
    """The stage's result from its fit (`fit_stage`): the evaluations before and after, the
    KL, the labels the rounds asked for, the attempts."""
    summary = run.summary
    evals = summary["evaluations"]
    return PolicyTrainResult(
        path=out_dir,
        audit_dir=audit_model_dir(out_dir),  # the workers saved it there when rounds trained one
        algorithm=cfg.algorithm,
        accuracy_before=evals[0].get("eval/accuracy"),
        accuracy_after=evals[-1].get("eval/accuracy"),
        rm_score_before=evals[0].get("eval/rm_score"),
        rm_score_after=evals[-1].get("eval/rm_score"),
        audit_score_before=evals[0].get("eval/audit_score"),
        audit_score_after=evals[-1].get("eval/audit_score"),
        labels_asked=summary["labels_asked"],
        round_pairs=len(summary["round_pairs"]),
        kl_final=summary["kl_final"],
        kl_max=summary["kl_max"],
        kl_bound=cfg.kl_bound,
        steps=summary["step"],
        nonfinite_skipped=summary["nonfinite_skipped"],
        run=run.record(),
        evaluations=evals,
        sync_checks=summary["sync_checks"],
        peak_memory=summary.get("peak_memory", {}),  # none when the circuit breaker stopped the run
    )


def _check_inputs(prompts, eval_prompts, eval_answers, sft_dir, reward_dir, cfg: PolicyConfig, answers=None) -> bool:
    """Raise ValueError for input that cannot train; -> whether the verifiable reward can be scored."""
    if len(prompts) == 0:
        raise ValueError("policy: no training prompts")
    if len(prompts) < cfg.prompts_per_step:
        raise ValueError(f"policy: {len(prompts)} training prompts are fewer than prompts_per_step={cfg.prompts_per_step}")
    if len(eval_prompts) == 0:
        raise ValueError("policy: no held-out eval prompts (their scores before/after are the stage's result)")
    if eval_answers and len(eval_prompts) != len(eval_answers):
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
    verifiable = resolve_verifiable_reward(cfg.verifiable_reward)
    if verifiable is None:
        return False
    parses = all(_parses(verifiable, p, answers or {}) for p in prompts)
    if cfg.verifiable_reward_weight > 0 and not parses:
        raise ValueError(
            f"policy: verifiable_reward_weight > 0 but not every training prompt is one "
            f"{cfg.verifiable_reward} can score"
        )
    return parses


def _parses(verifiable, prompt: str, answers: dict[str, str]) -> bool:
    try:
        score_verifiable(verifiable, [prompt], [""], answers)
        return True
    except ValueError:
        return False
