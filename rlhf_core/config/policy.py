"""The configs of policy optimisation: `policy` and its sections (PPO, GRPO, reward shaping,
the circuit breaker, preference rounds and their judge; the offline methods' sections are in
`rlhf_core.config.offline`, the rollout engines' and pipelined rollouts' in
`rlhf_core.config.rollout`), re-exported by `rlhf_core.config`."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlhf_core.config.inputs import Checker, _Strict
from rlhf_core.config.offline import DPOConfig, KTOConfig, LoRAConfig, OfflineTrainingConfig
from rlhf_core.config.rollout import RolloutEngineConfig, RolloutPipelineConfig


class PPOConfig(_Strict):
    """PPO with a token-level critic: GAE advantages, KL to the reference in the reward."""

    clip_range: float = Field(0.2, gt=0, lt=1, description="Clip range of the policy's probability ratio.")
    clip_range_value: float | None = Field(0.2, gt=0,
        description='Clip range of the value prediction around its old value; null: unclipped value loss.')
    gamma: float = Field(1.0, ge=0, le=1, description='Discount factor of the GAE returns.')
    lam: float = Field(0.95, ge=0, le=1, description='GAE lambda: bias-variance trade-off of the advantages.')
    vf_coef: float = Field(0.5, gt=0, description="Scales the critic's loss (the critic has its own optimizer).")
    critic_learning_rate: float = Field(1e-3, gt=0, description='Learning rate of the critic.')
    whiten_advantages: bool = Field(True, description='Normalise the advantages of each batch to mean 0, std 1.')


class GRPOConfig(_Strict):
    """GRPO: `group_size` samples per prompt, group-relative advantages, KL in the loss."""

    group_size: int = Field(8, ge=2, description='Responses sampled per prompt; advantages are relative to the group.')
    scale_by_std: bool = Field(True, description="Divide advantages by the group's std; false: Dr. GRPO.")
    clip_range: float = Field(0.2, gt=0, lt=1, description="Clip range of the policy's probability ratio.")


class RewardShapingConfig(_Strict):
    """How the reward models' scores become the policy's reward-model term
    (`rlhf_core.training.reward_shaping.proxy_reward`), in this order:

        aggregate   the ensemble members' normalised scores -> one score per response
        clip        to [-clip, clip]
        bounded     sigmoid((score - reference score) / bounded_scale): bounded above, and
                    flat once the policy beats the reference by a wide margin (PAR, Fu et al. 2025)
        length      minus length_penalty per token beyond the reference's mean length, and/or
                    the batch's linear dependence on length removed (length_decorrelate)

    With one member and every option off the term is the normalised score, as it always was.
    """

    aggregate: Literal["mean", "min", "mean_minus_std"] = Field(
        "mean", description="How the ensemble's members are combined: mean, worst case (min), or mean - std_coef * std (Coste et al. 2023).")
    std_coef: float = Field(1.0, ge=0, description="lambda of mean_minus_std.")
    clip: float | None = Field(None, gt=0, description="Clip the aggregated normalised score to [-clip, clip]; null: no clip.")
    bounded: bool = Field(False, description="Sigmoid of the score relative to the reference policy's mean score (bounded shaping).")
    bounded_scale: float = Field(1.0, gt=0, description="Temperature of the bounded shaping's sigmoid.")
    length_penalty: float = Field(0.0, ge=0, description="Reward subtracted per response token beyond the reference's mean length.")
    length_decorrelate: bool = Field(False, description="Remove the batch's least-squares dependence of the score on response length.")


class CircuitBreakerConfig(_Strict):
    """When RL training stops itself (`rlhf_core.training.circuit_breaker.should_trip`)."""

    enabled: bool = Field(True, description='Stop an unstable run and keep its last good checkpoint.')
    kl_patience: int = Field(3, ge=1,
        description='Steps in a row with policy/kl above policy.kl_bound before the run stops.')
    max_prob_diff_fp32: float | None = Field(0.01, gt=0,
        description="Largest rollout/prob_diff (mean |p_engine - p_trainer| of the sampled tokens) of a trainer "
                    "computing in fp32 before a step counts as out of sync with the engine (verl's problem bar); "
                    "null: off. Not checked with pipelined rollouts.")
    max_prob_diff_bf16: float | None = Field(0.05, gt=0,
        description="The same for a trainer computing in bf16, whose log-probs differ from the engine's by its "
                    "rounding too; null: off.")
    sync_patience: int = Field(3, ge=1,
        description='Steps in a row with rollout/prob_diff above its bound before the run stops.')
    max_consecutive_nonfinite: int = Field(2, ge=1,
        description='Steps in a row with a skipped non-finite update before the run stops.')
    entropy_floor: float | None = Field(None, ge=0,
        description='Entropy (nats) below which a step counts as collapsed; null: no entropy check.')
    entropy_patience: int = Field(3, ge=1, description='Steps in a row below entropy_floor before the run stops.')
    max_reward_drop: float | None = Field(None, gt=0,
        description="Largest drop of the windowed mean reward below the run's best; null: off.")
    reward_window: int = Field(3, ge=1, description='Steps averaged for the reward check.')
    max_audit_drop: float | None = Field(None, gt=0,
        description="Largest drop of the windowed mean audit reward-model score below its best while the proxy "
                    "score has not fallen (over-optimisation); null: off.")
    max_disagreement: float | None = Field(None, gt=0,
        description="Largest windowed mean std across the reward-model ensemble's members; null: off.")
    audit_window: int = Field(3, ge=1, description='Steps averaged for the over-optimisation checks.')


JUDGE_TEMPLATE = (
    "Which answer to the question is better? Reply with [[A]] or [[B]] only.\n\n"
    "Question: {prompt}\n\nAnswer A: {answer_a}\n\nAnswer B: {answer_b}\n\nVerdict: "
)


class JudgeConfig(_Strict):
    """An LLM judge behind an OpenAI-compatible endpoint (`rounds.annotator: llm_judge`), for AI
    feedback: one request per pair, its answer parsed into a preference or counted and skipped."""

    base_url: str | None = Field(None, description='The endpoint, e.g. http://127.0.0.1:8200/v1 (a vLLM-served judge).')
    model: str | None = Field(None, description='The model name the endpoint serves.')
    api_key_env: str = Field("RLHF_JUDGE_API_KEY", description='Environment variable holding the API key (unset: none sent).')
    api: Literal["completions", "chat"] = Field(
        "completions", description='/v1/completions with the rendered template, or /v1/chat/completions with it as the user turn.')
    template: str = Field(JUDGE_TEMPLATE, description='The request, with {prompt}, {answer_a} and {answer_b}.')
    parser: Literal["verdict", "match_answer"] = Field("verdict", description=(
        "verdict: the reply names [[A]] or [[B]] (or is A or B alone); match_answer: the judge answers the "
        "question itself and the one answer equal to its reply is preferred (reference-guided judging)."))
    max_tokens: int = Field(16, ge=1, description='Longest judge reply, in tokens.')
    timeout_s: float = Field(30.0, gt=0, description='Seconds one judge request may take.')

    @field_validator("template")
    @classmethod
    def _template_has_fields(cls, template: str) -> str:
        if "{prompt}" not in template:
            raise ValueError("the judge template must contain {prompt} (and, for the verdict parser, {answer_a} "
                             "and {answer_b})")
        return template


class RoundsConfig(_Strict):
    """Preference rounds on the policy's own answers (`rlhf_core.training.preference_rounds`):
    every `every` RL steps, two answers of the current policy to each of `prompts` fresh prompts
    are labelled by the annotator, pass the data contract, and the reward model continues
    training on them with `replay` old pairs per new one; the audit model never changes."""

    enabled: bool = Field(False, description='Run preference rounds during policy optimisation.')
    every: int = Field(10, ge=1, description='RL steps between rounds (none after the last step).')
    prompts: int = Field(64, ge=1, description='Fresh prompts per round; one pair of answers each.')
    samples_per_prompt: int = Field(4, ge=2, le=16, description=(
        "Answers sampled per prompt; the pair is the first two that differ (a peaked policy often "
        "repeats itself, and two equal answers are not worth a label)."))
    annotator: Literal["simulated", "llm_judge", "queue"] = Field("simulated", description=(
        "simulated: the task's answer key (the verifiable reward) with label noise; llm_judge: an OpenAI-"
        "compatible judge (rounds.judge); queue: a batch for people in queue_dir, labels picked up later."))
    label_noise: float = Field(0.1, ge=0, lt=0.5, description="Share of the simulated annotator's labels flipped.")
    replay: float = Field(1.0, ge=0, description='Earlier pairs replayed per new pair when the reward model trains.')
    epochs: int = Field(2, ge=1, description="Passes over a round's pairs (new and replayed).")
    batch_size: int = Field(32, ge=1, description='Pairs per reward-model optimizer step in a round.')
    learning_rate: float = Field(1e-4, gt=0, description='Learning rate of the reward model in a round.')
    queue_dir: Path | None = Field(None, description='The labelling queue (annotator queue); null: <output_dir>/labelling-queue.')
    audit_share: float = Field(0.25, ge=0, le=1, description=(
        "Share of each round's new pairs that train the audit reward model (reward.audit_share) instead of "
        "the proxy, so the audit keeps up with the policy's answers; the policy never trains against it."))
    train_proxy: bool = Field(True, description=(
        "Train the proxy reward model on the rounds' pairs; false: rounds only keep the audit model current "
        "(monitoring on a label budget, the policy's reward unchanged)."))
    judge: JudgeConfig = JudgeConfig()

    @model_validator(mode="after")
    def _judge_is_set(self) -> "RoundsConfig":
        if self.enabled and self.annotator == "llm_judge" and (self.judge.base_url is None or self.judge.model is None):
            raise ValueError("annotator llm_judge needs judge.base_url and judge.model")
        return self


class PolicyConfig(_Strict):
    """Policy optimisation (PPO | GRPO) on Ray Train + DeepSpeed with vLLM rollouts, or an
    offline method on the labels alone (DPO | KTO, see `dpo` and `kto`).

    One RL step samples `prompts_per_step` prompts (× `grpo.group_size` responses for GRPO,
    one for PPO: `rollouts_per_step`), then runs `epochs_per_step` passes over them in
    minibatches of `minibatch_size` sequences (global, across workers), each one optimizer
    step accumulated over micro-batches of `micro_batch_size` sequences per worker.
    """

    algorithm: Literal["ppo", "grpo", "dpo", "kto"] = Field(
        "grpo", description='RL algorithm (ppo, grpo), or an offline method on the labels alone: dpo (`policy.dpo`), '
                            'kto (`policy.kto`).')
    seed: int = Field(0, ge=0, description='Seed every rollout seed derives from (non-negative).')
    num_workers: int = Field(2, ge=1, description='Ray Train workers (data-parallel ranks).')
    use_gpu: bool | None = Field(None, description='Train on GPUs; null: use GPUs when the cluster has them.')
    placement_strategy: Literal["SPREAD", "PACK", "STRICT_SPREAD"] = Field(
        "SPREAD", description='How the workers are placed over the Ray nodes.')
    zero_stage: int = Field(2, ge=1, le=3,
        description="DeepSpeed ZeRO stage; at least 1, since the skip of non-finite gradients is ZeRO's.")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description=(
        "What the trainer's forward and backward passes compute in: bf16 (mixed precision: weights, gradients "
        "and optimizer state stay fp32) or fp32; auto: bf16 on a GPU that supports it, and on a CPU where a "
        "bf16 matrix multiply measures at least 1.3x as fast as fp32, else fp32. PPO and GRPO; the offline methods "
        "compute in fp32, and rollouts in the engine's dtype."))
    gradient_checkpointing: bool = Field(False, description=(
        "Recompute the policy's activations layer by layer in the backward pass instead of keeping them: less "
        "memory for about one more forward pass of compute (the actor; PPO's critic keeps its activations)."))
    steps: int = Field(30, ge=1, description='RL iterations.')
    prompts_per_step: int = Field(32, ge=1, description='Prompts sampled per RL step.')
    temperature: float = Field(1.0, gt=0, description='Sampling temperature of the rollouts.')
    top_p: float = Field(1.0, gt=0, le=1, description='Nucleus sampling of the rollouts (1: off).')
    max_new_tokens: int = Field(8, ge=1, description='Longest rollout response, in tokens.')
    epochs_per_step: int = Field(2, ge=1, description="Passes over each step's rollouts.")
    minibatch_size: int = Field(128, ge=1, description='Sequences per optimizer step, all workers together.')
    micro_batch_size: int = Field(64, ge=1, description='Sequences per forward/backward on one worker.')
    # 1e-4, not 2e-4: on the demo (4 seeds, bench/pipelined.py) held-out accuracy 0.945 (sd 0.011)
    # against 0.910 (sd 0.032), and the pipelined mode's lag then costs little
    learning_rate: float = Field(1e-4, gt=0, description='Learning rate of the policy.')
    max_grad_norm: float = Field(1.0, gt=0, description='Gradients are clipped to this global norm.')
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Estimator of the KL to the reference policy (Schulman's k1, k2, k3).")
    kl_coef: float = Field(0.02, ge=0,
        description='Weight of the KL to the reference (in the reward for PPO, in the loss for GRPO).')
    adaptive_kl_target: float | None = Field(None, gt=0,
        description='KL the adaptive controller steers kl_coef towards; null: fixed kl_coef.')
    adaptive_kl_horizon: float | None = Field(None, gt=0,
        description='Horizon of the adaptive KL controller; set together with adaptive_kl_target.')
    kl_bound: float = Field(10.0, gt=0,
        description='Per-sequence KL to the reference the run must stay under (the circuit breaker watches it).')
    entropy_coef: float = Field(0.0, ge=0, description='Weight of the entropy bonus.')
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "token-mean", description='How token losses are averaged into the batch loss.')
    # By default the reward is the reward model alone, which is what RLHF on preference data
    # means; a task with checkable answers can add (or use only) a verifiable reward.
    reward_model_weight: float = Field(1.0, ge=0, description="Weight of the reward model's score in the reward.")
    verifiable_reward_weight: float = Field(0.0, ge=0,
        description='Weight of the verifiable reward (exact answer); needs prompts the verifier can parse.')
    verifiable_reward: Checker | None = Field(
        None,
        description="The task's answer checker: a name registered in rlhf_core.training.verifiable."
        "VERIFIABLE_REWARDS (the demo's is addition_exact_match; answer_exact_match checks an "
        "`answer` column) or module:function, a function (prompts, responses) -> tensor of 0/1 per "
        "response. It is in the reward with verifiable_reward_weight > 0; at weight 0 it only "
        "measures, and labels for rounds.annotator simulated. null: none (the weight must be 0).",
    )
    eval_every: int = Field(10, ge=1, description='RL steps between held-out evaluations.')
    checkpoint_every: int = Field(10, ge=1, description='RL steps between checkpoints.')
    max_failures: int = Field(2, ge=0,
        description='Worker failures the run survives by resuming from its last checkpoint.')
    min_accuracy_gain: float = Field(0.0, ge=-1, le=1,
        description='The stage fails when held-out accuracy gains less than this over the SFT policy.')
    ppo: PPOConfig = PPOConfig()
    grpo: GRPOConfig = GRPOConfig()
    dpo: DPOConfig = DPOConfig()
    kto: KTOConfig = KTOConfig()
    lora: LoRAConfig = LoRAConfig()
    shaping: RewardShapingConfig = RewardShapingConfig()
    rounds: RoundsConfig = RoundsConfig()
    circuit_breaker: CircuitBreakerConfig = CircuitBreakerConfig()
    pipeline: RolloutPipelineConfig = RolloutPipelineConfig()
    rollout: RolloutEngineConfig = RolloutEngineConfig()

    @property
    def samples_per_prompt(self) -> int:
        return self.grpo.group_size if self.algorithm == "grpo" else 1

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def clip_range(self) -> float:
        return getattr(self, self.algorithm).clip_range

    @property
    def offline(self) -> OfflineTrainingConfig | None:
        """The offline method's section (`dpo`, `kto`); None for PPO and GRPO."""
        return {"dpo": self.dpo, "kto": self.kto}.get(self.algorithm)

    @property
    def offline_grad_accum_steps(self) -> int:
        return self.offline.batch_size // (self.num_workers * self.offline.micro_batch_size)

    @property
    def grad_accum_steps(self) -> int:
        return self.minibatch_size // (self.num_workers * self.micro_batch_size)

    @model_validator(mode="after")
    def _lora_fits_the_zero_stage(self) -> "PolicyConfig":
        if self.lora.enabled and self.zero_stage == 3:
            raise ValueError("policy.lora with zero_stage 3 is not supported (the stage does not gather the "
                             "sharded frozen base for the merge); use zero_stage 1 or 2: the adapters' optimizer "
                             "state is what ZeRO would shard, and it is small")
        return self

    @model_validator(mode="after")
    def _engines_of_their_own_are_separate(self) -> "PolicyConfig":
        r = self.rollout
        if r.placement == "colocated" and (r.num_engines > 1 or r.tensor_parallel_size > 1):
            raise ValueError(f"policy.rollout.num_engines={r.num_engines}, tensor_parallel_size={r.tensor_parallel_size} "
                             "need engines of their own: set policy.rollout.placement: separate (a colocated engine "
                             "is one engine on rank 0's device)")
        if r.placement == "separate" and r.sleep:
            raise ValueError("policy.rollout.sleep: true with placement: separate: engines of their own share no "
                             "device with the trainer, so there is nothing to free; set sleep to null or false")
        return self

    @model_validator(mode="after")
    def _a_pipelined_engine_stays_awake(self) -> "PolicyConfig":
        if self.rollout.sleep and self.pipeline.max_lag > 0:
            raise ValueError("policy.rollout.sleep: true with policy.pipeline.max_lag > 0: a pipelined engine "
                             "generates the next batch during the update; set one of them off")
        return self

    @model_validator(mode="after")
    def _offline_settings_agree(self) -> "PolicyConfig":
        """DPO/KTO: no rollouts, so only the method's own batches must divide."""
        if self.offline is None:
            return self
        d, name, w = self.offline, self.algorithm, self.num_workers
        if self.precision == "bf16":
            raise ValueError(f"policy.precision bf16 is for ppo and grpo; {name} computes in fp32: set "
                             "policy.precision=fp32 (or auto)")
        if self.rounds.enabled:
            raise ValueError(f"policy.rounds label the policy's own answers between RL steps; {name} trains on "
                             "the labels it is given: set policy.rounds.enabled=false or use ppo or grpo")
        if d.batch_size % (w * d.micro_batch_size):
            raise ValueError(
                f"{name}.batch_size ({d.batch_size}) must be a multiple of num_workers x {name}.micro_batch_size "
                f"({w} x {d.micro_batch_size})")
        return self

    @model_validator(mode="after")
    def _rl_batches_divide(self) -> "PolicyConfig":
        """PPO/GRPO: prompts over workers, rollouts into minibatches, minibatches into micro-batches."""
        if self.offline is not None:
            return self
        n, mb, w = self.rollouts_per_step, self.minibatch_size, self.num_workers
        if self.prompts_per_step % w:
            raise ValueError(
                f"prompts_per_step ({self.prompts_per_step}) must be divisible by num_workers ({w}): "
                "each worker takes whole prompt groups"
            )
        if n % mb:
            raise ValueError(
                f"rollouts per step ({n} = prompts_per_step {self.prompts_per_step} x {self.samples_per_prompt} "
                f"samples) must be divisible by minibatch_size ({mb})"
            )
        if mb % (w * self.micro_batch_size):
            raise ValueError(
                f"minibatch_size ({mb}) must be divisible by num_workers x micro_batch_size "
                f"({w} x {self.micro_batch_size})"
            )
        return self

    @model_validator(mode="after")
    def _rl_settings_agree(self) -> "PolicyConfig":
        """PPO/GRPO: the KL controller, the reward weights and the pipelined sampler."""
        if self.offline is not None:
            return self
        if (self.adaptive_kl_target is None) != (self.adaptive_kl_horizon is None):
            raise ValueError("adaptive_kl_target and adaptive_kl_horizon must be set together (or neither)")
        if self.reward_model_weight == 0 and self.verifiable_reward_weight == 0:
            raise ValueError("reward_model_weight and verifiable_reward_weight are both 0: there is no reward")
        if self.pipeline.chunks > self.prompts_per_step:
            raise ValueError(
                f"pipeline.chunks ({self.pipeline.chunks}) must not exceed prompts_per_step ({self.prompts_per_step}): "
                "each chunk generates whole prompt groups"
            )
        if self.pipeline.max_lag > 0 and self.top_p < 1:
            raise ValueError(
                f"pipeline.max_lag > 0 needs top_p = 1 (got {self.top_p}): the lag correction divides by the "
                "sampler's probability of each token, which top-p renormalises over the nucleus"
            )
        return self

    @model_validator(mode="after")
    def _verifiable_weight_has_a_reward(self) -> "PolicyConfig":
        if self.verifiable_reward is None and self.verifiable_reward_weight > 0:
            raise ValueError(
                f"verifiable_reward is null but verifiable_reward_weight is {self.verifiable_reward_weight}: "
                "name a verifiable reward or set its weight to 0"
            )
        if self.rounds.enabled and self.rounds.annotator == "simulated" and self.verifiable_reward is None:
            raise ValueError("rounds.annotator simulated labels with the task's answer key, but verifiable_reward "
                             "is null: name one (its weight may be 0), or use annotator llm_judge or queue")
        return self
