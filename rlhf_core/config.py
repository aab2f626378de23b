"""Typed pipeline configuration.

One validated config per stage; `PipelineConfig` composes them and is loaded from one YAML
file (`configs/demo.yaml` is the embedded default). Unknown keys, wrong types and
out-of-range values are rejected before anything runs, with the key path in the message:

    policy.ppo.clip_range: must be > 0, got -1
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlhf_core.config_inputs import (  # noqa: F401 - re-exported: callers import every config from here
    DataConfig, DemoDataConfig, ModelConfig, TokenizerConfig, ValidationConfig, _Strict,
)
from rlhf_core.config_offline import (  # noqa: F401 - re-exported: callers import every config from here
    DPOConfig, KTOConfig, LoRAConfig, OfflineTrainingConfig,
)
from rlhf_core.training.verifiable import check_verifiable_reward


class SFTConfig(_Strict):
    """Supervised fine-tuning of the base policy on the SFT corpus (loss on answer tokens only).

    From scratch for the demo; from `model.pretrained` when set. Off (`enabled: false`), the
    pretrained model itself is the base policy."""

    enabled: bool = Field(True, description='Fine-tune the base policy; false: model.pretrained is the base as it is.')
    seed: int = Field(0, description='Seed of initialisation and data order.')
    epochs: int = Field(14, ge=1, description='Passes over the SFT corpus.')
    batch_size: int = Field(64, ge=1, description='Sequences per optimizer step.')
    learning_rate: float = Field(2e-3, gt=0, description='Peak learning rate, reached after the warm-up.')
    weight_decay: float = Field(0.0, ge=0, description='AdamW weight decay.')
    warmup_steps: int = Field(20, ge=0, description='Optimizer steps of linear learning-rate warm-up.')
    max_grad_norm: float = Field(1.0, gt=0, description='Gradients are clipped to this global norm.')
    max_new_tokens: int = Field(8, ge=1, description='Tokens generated per prompt for the held-out accuracy check.')
    min_eval_accuracy: float = Field(0.0, ge=0, le=1,
        description='The stage fails when held-out accuracy is below this.')


class RewardConfig(_Strict):
    """Bradley-Terry reward model on Ray Train + DeepSpeed.

    The global batch is `micro_batch_size × num_workers × grad_accum_steps` pairs
    (`global_batch_size`); each worker reads a disjoint shard of the training pairs.
    """

    base_model: str | None = Field(None, description=(
        "Hugging Face directory (or hub id) whose backbone the reward model starts from; null: the base "
        "policy's. Its tokenizer reads the same rendered text."))
    seed: int = Field(0, description='Seed of initialisation, the held-out split and data order.')
    num_workers: int = Field(2, ge=1, description='Ray Train workers (data-parallel ranks).')
    use_gpu: bool | None = Field(None, description='Train on GPUs; null: use GPUs when the cluster has them.')
    placement_strategy: Literal["SPREAD", "PACK", "STRICT_SPREAD"] = Field(
        "SPREAD", description='How the workers are placed over the Ray nodes.')
    zero_stage: int = Field(2, ge=0, le=3, description='DeepSpeed ZeRO stage (0: plain data parallel).')
    micro_batch_size: int = Field(32, ge=1, description='Pairs per forward/backward on one worker.')
    grad_accum_steps: int = Field(1, ge=1, description='Micro-batches accumulated per optimizer step.')
    epochs: int = Field(4, ge=1, description='Passes over the training pairs.')
    learning_rate: float = Field(3e-4, gt=0, description='Peak learning rate, reached after the warm-up.')
    weight_decay: float = Field(0.0, ge=0, description='AdamW weight decay.')
    warmup_steps: int = Field(10, ge=0, description='Optimizer steps of linear learning-rate warm-up.')
    max_grad_norm: float = Field(1.0, gt=0, description='Gradients are clipped to this global norm.')
    max_length: int = Field(32, ge=4, description='Longest scored sequence in tokens (prompt + response + </s>).')
    on_overlength: Literal["truncate", "reject"] = Field(
        "truncate", description='A longer pair is cut to max_length (truncate) or fails the stage naming the rows (reject).')
    margin: float = Field(
        0.0, description='Margin by which the chosen reward should exceed the rejected one in the Bradley-Terry loss.')
    eval_share: float = Field(0.1, gt=0, lt=1, description='Held-out share of the pairs, split by prompt.')
    checkpoint_every: int = Field(20, ge=1, description='Optimizer steps between checkpoints.')
    max_failures: int = Field(2, ge=0,
        description='Worker failures the run survives by resuming from its last checkpoint.')
    min_eval_accuracy: float = Field(0.9, ge=0, le=1,
        description='The stage fails when held-out pairwise accuracy is below this.')
    ensemble_size: int = Field(1, ge=1, le=16, description=(
        'Reward-model ensemble members: score heads on one backbone, each trained on its own Poisson '
        'bootstrap of the pairs (1: one plain reward model). The policy combines them by policy.shaping.aggregate.'))
    audit_share: float = Field(0.0, ge=0, lt=1, description=(
        'Share of the training pairs (split by prompt) held back to train a separate audit reward model, '
        'which the policy never trains against; it is measured on every step and judged by the gates. 0: no audit.'))

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_workers * self.grad_accum_steps


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


class RolloutPipelineConfig(_Strict):
    """Pipelined rollouts (`rlhf_core.rollout.pipeline`): the engine generates the next steps'
    batches while the trainer updates on the current one, taking new weights in flight.

    max_lag 0 is the synchronous loop (generate, then train, then sync). With max_lag k the
    batch of step s may be sampled by a policy up to k updates older than the one it trains
    (s - 1 - k instead of s - 1); each token's loss is then weighted by the truncated
    importance ratio min(pi_old / mu, is_cap) of the trainer's policy to the sampler's.
    """

    max_lag: int = Field(0, ge=0, le=8,
        description='Policy updates a rollout batch may lag behind the policy it trains; 0: synchronous.')
    is_cap: float = Field(2.0, ge=1, description='Truncation of the per-token importance weight of lagged samples.')
    chunks: int = Field(2, ge=1, description='Generate calls per batch; new weights are taken between them.')


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
    # On the demo the reward model alone is exploited: its score rises while exact match falls.
    # The verifiable reward carries the gain; the RM term stays, small, as the RLHF signal a
    # real task would weight up.
    reward_model_weight: float = Field(0.25, ge=0, description="Weight of the reward model's score in the reward.")
    verifiable_reward_weight: float = Field(1.0, ge=0,
        description='Weight of the verifiable reward (exact answer); needs prompts the verifier can parse.')
    verifiable_reward: str | None = Field(
        "addition_exact_match",
        description="The verifiable reward: a name registered in rlhf_core.training.verifiable."
        "VERIFIABLE_REWARDS (the demo's is addition_exact_match) or module:function, a function "
        "(prompts, responses) -> tensor of 0/1 per response; null for none (then "
        "verifiable_reward_weight must be 0).",
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
    def _batches_divide(self) -> "PolicyConfig":
        n, mb, w = self.rollouts_per_step, self.minibatch_size, self.num_workers
        if self.lora.enabled and self.offline is None:
            raise ValueError(f"policy.lora is used by the offline methods (dpo, kto); {self.algorithm} trains every "
                             "weight: set policy.lora.enabled=false")
        if self.offline is not None:  # no rollouts: only the method's own batches must divide
            d, name = self.offline, self.algorithm
            if self.lora.enabled and self.zero_stage == 3:
                raise ValueError("policy.lora with zero_stage 3 is not supported (the stage does not gather the "
                                 "sharded frozen base for the merge); use zero_stage 1 or 2: the adapters' optimizer "
                                 "state is what ZeRO would shard, and it is small")
            if self.rounds.enabled:
                raise ValueError(f"policy.rounds label the policy's own answers between RL steps; {name} trains on "
                                 "the labels it is given: set policy.rounds.enabled=false or use ppo or grpo")
            if d.batch_size % (w * d.micro_batch_size):
                raise ValueError(
                    f"{name}.batch_size ({d.batch_size}) must be a multiple of num_workers x {name}.micro_batch_size "
                    f"({w} x {d.micro_batch_size})")
            return self
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

    @field_validator("verifiable_reward")
    @classmethod
    def _verifiable_reward_resolves(cls, name: str | None) -> str | None:
        check_verifiable_reward(name)  # raises ValueError naming the registered ones
        return name

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


class GateConfig(_Strict):
    """Promotion gates on held-out prompts (`rlhf_core.eval.gates.gate`): a trained policy
    replaces the champion only when every check passes (and `auto_promote` is on)."""

    eval_prompts: int = Field(200, ge=1, description='Held-out prompts evaluated.')
    min_accuracy_gain: float = Field(0.0, ge=-1, le=1,
        description='Least accuracy gain over the reference (SFT) policy.')
    max_regression_vs_champion: float = Field(0.02, ge=0, le=1,
        description="Largest accuracy drop below the champion's.")
    min_win_rate_vs_reference: float = Field(0.5, ge=0, le=1,
        description='Least reward-model win rate against the reference (ties count half).')
    min_win_rate_vs_champion: float = Field(0.5, ge=0, le=1,
        description='Least reward-model win rate against the champion (ties count half).')
    min_audit_win_rate_vs_reference: float = Field(0.5, ge=0, le=1, description=(
        'Least win rate against the reference under the audit reward model (reward.audit_share), which '
        'the policy never trained against; skipped without an audit model.'))
    max_proxy_audit_gap: float | None = Field(None, gt=0, le=1, description=(
        "Largest amount by which the candidate's win rate against the reference under the reward model it "
        "trained on may exceed its win rate under the audit model; null: not checked."))
    win_rate_margin_vs_champion: float = Field(0.05, ge=0, le=1, description=(
        "With intervals: a candidate is rejected against the champion only when its win rate's interval lies "
        "below min_win_rate_vs_champion by more than this; in between it is undecided (not promoted)."))
    confidence: float | None = Field(0.95, gt=0, lt=1, description=(
        "Level of the paired bootstrap intervals the comparisons with the reference and the champion are "
        "judged on; null: point estimates."))
    bootstrap_samples: int = Field(2000, ge=100, description="Resamples of the prompts per interval.")
    max_kl: float = Field(10.0, gt=0,
        description='Largest per-sequence KL to the reference (the unit of policy.kl_bound).')
    max_length_ratio: float = Field(1.5, gt=0, description="Largest mean response length relative to the reference's.")
    max_degenerate_rate: float = Field(0.05, ge=0, le=1, description='Largest share of empty or looping responses.')
    max_generation_failure_rate: float = Field(0.01, ge=0, le=1,
        description='Largest share of prompts that failed to generate.')
    auto_promote: bool = Field(
        False, description='Promote a passing candidate to champion (and serve it); false: it waits for a person.')


class ServingConfig(_Strict):
    """Serving the champion with vLLM's OpenAI-compatible server (`rlhf_core.serving`).

    Blue/green: a new deployment starts on whichever of `ports` the current server does not
    use, must pass a health check and a smoke completion, and only then becomes the current
    endpoint (recorded in `<state_dir>/current.json`); the old server is stopped after that.
    """

    enabled: bool = Field(True, description='Deploy after a promotion inside the pipeline.')
    host: str = Field(
        "127.0.0.1", description='Bind address; anything but loopback exposes the API beyond this machine.')
    ports: tuple[int, int] = Field((8100, 8101), description='The blue and green ports.')
    api_key_env: str = Field(
        "RLHF_SERVING_API_KEY", description='Environment variable holding the API key; unset: a key is generated into <state_dir>/api_key.')
    state_dir: Path | None = Field(None, description='Where the serving state lives; null: <output_dir>/serving.')
    dtype: str = Field("float32", description='vLLM --dtype ("auto" or "bfloat16" on GPU).')
    max_model_len: int | None = Field(None, ge=8,
        description="Longest sequence served; null: the model's max_position_embeddings.")
    kv_cache_gib: float = Field(0.5, gt=0,
        description="KV cache of vLLM's CPU backend in GiB (VLLM_CPU_KVCACHE_SPACE).")
    chunked_prefill: bool = Field(
        False, description='vLLM chunked prefill; off on CPU, where it crashes on seeded requests it splits.')
    startup_timeout_s: float = Field(300.0, gt=0, description='Seconds a new server has until /health answers 200.')
    smoke_prompt: str = Field("Hello", description='Completed once before the new server takes traffic.')
    smoke_max_tokens: int = Field(8, ge=1, description='Tokens of the smoke completion.')
    cpu_threads_bind: str = Field(
        "nobind", description="vLLM's VLLM_CPU_OMP_THREADS_BIND for the servers it starts (CPU backend only): "
        '"nobind" lets the OS schedule them, so that a new server starting beside one under traffic gets CPU '
        '(vLLM\'s "auto" binds both to the same cores); "auto" or core lists such as "0-3" for a dedicated machine.')
    drain_timeout_s: float = Field(
        30.0, ge=0, description="After a switch, seconds the previous server has to finish the requests it is "
        "answering before it is stopped.")
    extra_args: list[str] = Field([], description='Passed on to vllm.entrypoints.openai.api_server.')

    @model_validator(mode="after")
    def _distinct_ports(self) -> "ServingConfig":
        if self.ports[0] == self.ports[1]:
            raise ValueError("ports must be two different ports (blue, green)")
        return self


class FeedbackConfig(_Strict):
    """The feedback gateway in front of the served model, and what becomes of its ratings.

    The gateway (`rlhf gateway`) passes OpenAI-compatible requests to whatever serves now
    (`<serving state_dir>/current.json`), records every answer, and takes ratings at
    `POST /v1/feedback` (docs/feedback.md). `collect-feedback` turns the ratings into
    preference datasets; the pipeline trains on them beside its base data when `use` is on.
    """

    host: str = Field("127.0.0.1", description="The gateway's bind address; anything but loopback exposes it.")
    port: int = Field(8200, ge=1, le=65535, description="The gateway's port.")
    store_url: str | None = Field(
        None, description="SQLAlchemy URL of the feedback store (postgresql://... to share one between gateways); "
        "null: SQLite <serving state_dir>/feedback.db.")
    store_url_env: str = Field(
        "RLHF_FEEDBACK_STORE_URL", description="Environment variable that, when set and non-empty, holds the store's "
        "URL instead of store_url: a PostgreSQL URL carries a password, which belongs in a secret, not a config file.")
    salt_file: Path | None = Field(
        None, description="File holding the secret that user ids are hashed with; gateways sharing a store must share "
        "it. null: <serving state_dir>/user_salt, generated (mode 0600) on first use.")
    ratings_per_minute: int = Field(
        60, ge=1, description="Feedback one user may send per minute; more is refused (429) and counted.")
    max_samples: int = Field(4, ge=1, le=16, description="Largest n a client may ask for (answers to choose between).")
    upstream_timeout_s: float = Field(120.0, gt=0, description="Seconds the gateway waits for the served model.")
    export_dir: Path | None = Field(
        None, description="Where collect-feedback writes its datasets; null: <output_dir>/feedback.")
    settle_s: float = Field(
        5.0, ge=0, description="An export covers feedback older than this many seconds, so that a write still "
        "in flight when the export starts falls into the next one.")
    max_user_share: float = Field(
        0.2, gt=0, le=1, description="A user whose ratings are more than this share of an export's (and more than "
        "min_user_flood of them) is left out of it as a flood.")
    min_user_flood: int = Field(20, ge=1, description="Fewest ratings from one user before max_user_share applies.")
    use: bool = Field(False, description="Train on the collected feedback datasets beside the base preference data.")
    weight: float = Field(
        1.0, ge=0, le=1, description="Share of the feedback pairs trained on (a seeded sample; 1: all). Pairs are "
        "never repeated: a (prompt, chosen, rejected) already in the data is left out, as the data contract "
        "refuses repeated pairs.")
    recency_days: float | None = Field(
        30.0, gt=0, description="Only feedback datasets exported in the last recency_days days; null: all.")


class MonitoringConfig(_Strict):
    """Prometheus export of the training jobs: one endpoint per job (`monitoring.prometheus`),
    listed for Prometheus in a file_sd target file."""

    enabled: bool = Field(True, description="Export the training jobs' metrics to Prometheus.")
    host: str = Field("127.0.0.1", description="The exporter's bind address; 0.0.0.0 when workers run on other nodes.")
    port: int = Field(0, ge=0, le=65535,
        description="The exporter's port; 0: any free port (the target file says which).")
    advertise_host: str | None = Field(None, description='The address workers and Prometheus use; null: host.')
    targets_dir: Path | None = Field(
        None, description='Where the file_sd target files go; null: <output_dir>/prometheus-targets.')
    linger_on_failure_s: float = Field(15.0, ge=0,
        description="Seconds a failed job's endpoint stays up so its alerts can fire.")


class TrackingConfig(_Strict):
    """MLflow. `tracking_uri` None means $MLFLOW_TRACKING_URI, else SQLite in the cwd."""

    tracking_uri: str | None = Field(
        None, description='MLflow tracking URI; null: $MLFLOW_TRACKING_URI, else SQLite mlflow.db in the working directory.')
    experiment: str = Field("rlhf-pipeline", description='MLflow experiment of the runs.')


class PipelineConfig(_Strict):
    """The whole pipeline: one section per stage, loaded from one YAML file."""

    name: str = Field("demo", description="Name of the run; the run's MLflow name and output directory start with it.")
    output_dir: Path = Field(
        Path("runs"), description='Where runs write their outputs (relative paths: to the working directory).')
    data: DataConfig = DataConfig()
    validation: ValidationConfig = ValidationConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = ModelConfig()
    sft: SFTConfig = SFTConfig()
    reward: RewardConfig = RewardConfig()
    policy: PolicyConfig = PolicyConfig()
    gates: GateConfig = GateConfig()
    serving: ServingConfig = ServingConfig()
    feedback: FeedbackConfig = FeedbackConfig()
    monitoring: MonitoringConfig = MonitoringConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _sft_off_needs_a_pretrained_model(self) -> "PipelineConfig":
        if not self.sft.enabled and self.model.pretrained is None:
            raise ValueError("sft.enabled is false but model.pretrained is not set: there is no base policy")
        return self


# Loading YAML into a PipelineConfig (and its error) lives in its own module, re-exported here:
# callers use `rlhf_core.config` for both.
from rlhf_core.config_loading import ConfigError, apply_overrides, load_config, parse_config  # noqa: E402

__all__ = [name for name in dir() if name.endswith("Config")] + [
    "ConfigError", "apply_overrides", "load_config", "parse_config",
]
