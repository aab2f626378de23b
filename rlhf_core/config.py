"""Typed pipeline configuration.

One validated config per stage; `PipelineConfig` composes them and is loaded from one YAML
file (`configs/demo.yaml` is the embedded default). Unknown keys, wrong types and
out-of-range values are rejected before anything runs, with the key path in the message:

    policy.ppo.clip_range: must be > 0, got -1
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlhf_core.training.verifiable import check_verifiable_reward


class ConfigError(ValueError):
    """A config that cannot be used. `problems` holds one `key.path: message` per error."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        super().__init__(f"{source}: invalid configuration\n  " + "\n  ".join(problems))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DemoDataConfig(_Strict):
    """The synthetic arithmetic task that the embedded demo generates locally.

    Prompts are `07+48=` with operands in [0, max_operand], zero-padded to its width; the
    answer is the sum padded to one more digit (`055`). The SFT
    corpus teaches a plausible systematic mistake, adding digit by digit without carrying,
    in `wrong_share` of its examples, so the SFT policy is clearly imperfect and RL has a
    real gain to find. Preference pairs always prefer the correct sum.
    """

    seed: int = 0
    max_operand: int = Field(99, ge=9, le=9999)
    n_sft: int = Field(8000, ge=10)
    n_pairs: int = Field(3000, ge=10)
    n_eval: int = Field(200, ge=10)
    wrong_share: float = Field(0.6, ge=0.0, le=1.0)
    near_miss_share: float = Field(0.1, ge=0.0, le=1.0)  # pairs rejecting a ±1/±10 answer, not the no-carry one


class DataConfig(_Strict):
    """Where preference data comes from. Without paths, the demo generator writes them."""

    preferences_path: Path | None = None
    eval_path: Path | None = None
    sft_path: Path | None = None  # `prompt`, `completion`; default: the pairs' chosen responses
    demo: DemoDataConfig = DemoDataConfig()

    @model_validator(mode="after")
    def _eval_needs_preferences(self) -> "DataConfig":
        if self.preferences_path is None and (self.eval_path or self.sft_path):
            raise ValueError("eval_path or sft_path is set but preferences_path is not")
        return self


class ValidationConfig(_Strict):
    """Thresholds of the preference-data contract (Great Expectations suite)."""

    min_rows: int = Field(100, ge=1)
    min_chars: int = Field(1, ge=1)
    max_chars: int = Field(4000, ge=1)
    max_duplicate_prompt_share: float = Field(0.5, ge=0.0, le=1.0)
    check_eval_leakage: bool = True
    sample_rows: int = Field(5, ge=1, le=100)  # offending rows shown per failed expectation

    @model_validator(mode="after")
    def _bounds_ordered(self) -> "ValidationConfig":
        if self.min_chars > self.max_chars:
            raise ValueError(f"min_chars ({self.min_chars}) must be <= max_chars ({self.max_chars})")
        return self


class TokenizerConfig(_Strict):
    vocab_size: int = Field(320, ge=32, le=65536)


class ModelConfig(_Strict):
    """A tiny Llama-architecture causal LM, created locally (no hub)."""

    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(384, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(4, ge=1)
    max_position_embeddings: int = Field(64, ge=16)
    # Std of the initial weights (Hugging Face's `initializer_range`). At 0.02 the tiny demo
    # model's attention starts near uniform and escapes that saddle late, at a step that varies
    # with the seed and the CPU's kernels; a larger scale escapes it early for every seed.
    initializer_range: float = Field(0.02, gt=0, le=1)

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        return self


class SFTConfig(_Strict):
    """Supervised fine-tuning of the base policy on the SFT corpus (loss on answer tokens)."""

    seed: int = 0
    epochs: int = Field(14, ge=1)
    batch_size: int = Field(64, ge=1)
    learning_rate: float = Field(2e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(20, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    max_new_tokens: int = Field(8, ge=1)  # for the held-out accuracy check
    min_eval_accuracy: float = Field(0.0, ge=0, le=1)  # below this the stage fails


class RewardConfig(_Strict):
    """Bradley-Terry reward model on Ray Train + DeepSpeed.

    The global batch is `micro_batch_size × num_workers × grad_accum_steps` pairs
    (`global_batch_size`); each worker reads a disjoint shard of the training pairs.
    """

    seed: int = 0
    num_workers: int = Field(2, ge=1)
    use_gpu: bool | None = None  # None: use GPUs when the cluster has them
    placement_strategy: Literal["SPREAD", "PACK", "STRICT_SPREAD"] = "SPREAD"  # workers over the Ray nodes
    zero_stage: int = Field(2, ge=0, le=3)
    micro_batch_size: int = Field(32, ge=1)
    grad_accum_steps: int = Field(1, ge=1)
    epochs: int = Field(4, ge=1)
    learning_rate: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(10, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    max_length: int = Field(32, ge=4)  # tokens of prompt + response + </s>
    on_overlength: Literal["truncate", "reject"] = "truncate"
    margin: float = 0.0
    eval_share: float = Field(0.1, gt=0, lt=1)  # held-out share of the pairs, split by prompt
    checkpoint_every: int = Field(20, ge=1)  # optimizer steps
    max_failures: int = Field(2, ge=0)  # worker failures the run survives by resuming
    min_eval_accuracy: float = Field(0.9, ge=0, le=1)  # below this the stage fails

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_workers * self.grad_accum_steps


class PPOConfig(_Strict):
    """PPO with a token-level critic: GAE advantages, KL to the reference in the reward."""

    clip_range: float = Field(0.2, gt=0, lt=1)
    clip_range_value: float | None = Field(0.2, gt=0)  # None: unclipped value loss
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    vf_coef: float = Field(0.5, gt=0)  # scales the critic's loss (its own optimizer)
    critic_learning_rate: float = Field(1e-3, gt=0)
    whiten_advantages: bool = True


class GRPOConfig(_Strict):
    """GRPO: `group_size` samples per prompt, group-relative advantages, KL in the loss."""

    group_size: int = Field(8, ge=2)
    scale_by_std: bool = True  # False: Dr. GRPO (no division by the group's std)
    clip_range: float = Field(0.2, gt=0, lt=1)


class CircuitBreakerConfig(_Strict):
    """When RL training stops itself (`rlhf_core.training.circuit_breaker.should_trip`)."""

    enabled: bool = True
    kl_patience: int = Field(3, ge=1)  # steps in a row with policy/kl > policy.kl_bound
    max_consecutive_nonfinite: int = Field(2, ge=1)  # steps in a row with a skipped non-finite update
    entropy_floor: float | None = Field(None, ge=0)  # nats; None: no entropy check
    entropy_patience: int = Field(3, ge=1)
    max_reward_drop: float | None = Field(None, gt=0)  # below the run's best windowed mean; None: off
    reward_window: int = Field(3, ge=1)  # steps averaged for the reward check


class RolloutPipelineConfig(_Strict):
    """Pipelined rollouts (`rlhf_core.rollout.pipeline`): the engine generates the next steps'
    batches while the trainer updates on the current one, taking new weights in flight.

    max_lag 0 is the synchronous loop (generate, then train, then sync). With max_lag k the
    batch of step s may be sampled by a policy up to k updates older than the one it trains
    (s - 1 - k instead of s - 1); each token's loss is then weighted by the truncated
    importance ratio min(pi_old / mu, is_cap) of the trainer's policy to the sampler's.
    """

    max_lag: int = Field(0, ge=0, le=8)  # 0: synchronous
    is_cap: float = Field(2.0, ge=1)  # truncation of the per-token importance weight
    chunks: int = Field(2, ge=1)  # generate calls per batch: new weights are taken between them


class PolicyConfig(_Strict):
    """Policy optimisation (PPO | GRPO) on Ray Train + DeepSpeed with vLLM rollouts.

    One RL step samples `prompts_per_step` prompts (× `grpo.group_size` responses for GRPO,
    one for PPO: `rollouts_per_step`), then runs `epochs_per_step` passes over them in
    minibatches of `minibatch_size` sequences (global, across workers), each one optimizer
    step accumulated over micro-batches of `micro_batch_size` sequences per worker.
    """

    algorithm: Literal["ppo", "grpo"] = "grpo"
    seed: int = Field(0, ge=0)  # rollout seeds derive from it (SeedSequence: non-negative)
    num_workers: int = Field(2, ge=1)
    use_gpu: bool | None = None  # None: use GPUs when the cluster has them
    placement_strategy: Literal["SPREAD", "PACK", "STRICT_SPREAD"] = "SPREAD"  # workers over the Ray nodes
    zero_stage: int = Field(2, ge=1, le=3)  # >= 1: the non-finite-gradient skip is ZeRO's
    steps: int = Field(30, ge=1)  # RL iterations
    prompts_per_step: int = Field(32, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(8, ge=1)
    epochs_per_step: int = Field(2, ge=1)  # K passes over each step's rollouts
    minibatch_size: int = Field(128, ge=1)  # sequences per optimizer step, all workers together
    micro_batch_size: int = Field(64, ge=1)  # sequences per forward/backward on one worker
    # 1e-4, not 2e-4: on the demo (4 seeds, bench/pipelined.py) held-out accuracy 0.945 (sd 0.011)
    # against 0.910 (sd 0.032), and the pipelined mode's lag then costs little
    learning_rate: float = Field(1e-4, gt=0)
    max_grad_norm: float = Field(1.0, gt=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_coef: float = Field(0.02, ge=0)
    adaptive_kl_target: float | None = Field(None, gt=0)  # None: fixed kl_coef
    adaptive_kl_horizon: float | None = Field(None, gt=0)
    kl_bound: float = Field(10.0, gt=0)  # per-sequence KL to the reference the run must stay under
    entropy_coef: float = Field(0.0, ge=0)
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    # The demo's reward model (held-out pairwise accuracy ~0.76) alone is exploited: its score
    # rises while exact match falls (0.37 -> 0.03). The verifiable reward carries the gain
    # (0.37 -> ~0.9); the RM term stays, small, as the RLHF signal a real task would weight up.
    reward_model_weight: float = Field(0.25, ge=0)
    verifiable_reward_weight: float = Field(1.0, ge=0)  # needs prompts the verifier can parse
    verifiable_reward: str | None = Field(
        "addition_exact_match",
        description="The verifiable reward: a name registered in rlhf_core.training.verifiable."
        "VERIFIABLE_REWARDS (the demo's is addition_exact_match) or module:function, a function "
        "(prompts, responses) -> tensor of 0/1 per response; null for none (then "
        "verifiable_reward_weight must be 0).",
    )
    eval_every: int = Field(10, ge=1)  # RL steps between held-out evaluations
    checkpoint_every: int = Field(10, ge=1)  # RL steps between checkpoints
    max_failures: int = Field(2, ge=0)
    min_accuracy_gain: float = Field(0.0, ge=-1, le=1)  # the stage fails below this gain
    ppo: PPOConfig = PPOConfig()
    grpo: GRPOConfig = GRPOConfig()
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
    def grad_accum_steps(self) -> int:
        return self.minibatch_size // (self.num_workers * self.micro_batch_size)

    @model_validator(mode="after")
    def _batches_divide(self) -> "PolicyConfig":
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
        return self


class GateConfig(_Strict):
    """Promotion gates on held-out prompts (`rlhf_core.eval.gates.gate`): a trained policy
    replaces the champion only when every check passes (and `auto_promote` is on)."""

    eval_prompts: int = Field(200, ge=1)  # held-out prompts evaluated
    min_accuracy_gain: float = Field(0.0, ge=-1, le=1)  # over the reference (SFT) policy
    max_regression_vs_champion: float = Field(0.02, ge=0, le=1)  # accuracy below the champion's
    min_win_rate_vs_reference: float = Field(0.5, ge=0, le=1)  # reward-model win rate, ties count half
    min_win_rate_vs_champion: float = Field(0.5, ge=0, le=1)
    max_kl: float = Field(10.0, gt=0)  # per-sequence KL to the reference, the unit of policy.kl_bound
    max_length_ratio: float = Field(1.5, gt=0)  # mean length / reference mean length
    max_degenerate_rate: float = Field(0.05, ge=0, le=1)  # empty or looping responses
    max_generation_failure_rate: float = Field(0.01, ge=0, le=1)  # prompts that failed to generate
    auto_promote: bool = False  # False: a passing candidate still waits for a human


class ServingConfig(_Strict):
    """Serving the champion with vLLM's OpenAI-compatible server (`rlhf_core.serving`).

    Blue/green: a new deployment starts on whichever of `ports` the current server does not
    use, must pass a health check and a smoke completion, and only then becomes the current
    endpoint (recorded in `<state_dir>/current.json`); the old server is stopped after that.
    """

    enabled: bool = True  # deploy after a promotion inside the pipeline
    host: str = "127.0.0.1"  # bind address; anything else exposes the API beyond this machine
    ports: tuple[int, int] = (8100, 8101)  # blue / green
    api_key_env: str = "RLHF_SERVING_API_KEY"  # unset: a key is generated into <state_dir>/api_key
    state_dir: Path | None = None  # None: <output_dir>/serving
    dtype: str = "float32"  # vLLM --dtype ("auto" / "bfloat16" on GPU)
    max_model_len: int | None = Field(None, ge=8)  # None: the model's max_position_embeddings
    kv_cache_gib: float = Field(0.5, gt=0)  # CPU backend KV cache (VLLM_CPU_KVCACHE_SPACE)
    chunked_prefill: bool = False  # vLLM on CPU crashes on seeded requests it splits; on for GPU
    startup_timeout_s: float = Field(300.0, gt=0)  # until /health answers 200
    smoke_prompt: str = "Hello"  # completed once before the new server takes traffic
    smoke_max_tokens: int = Field(8, ge=1)
    extra_args: list[str] = []  # passed on to vllm.entrypoints.openai.api_server

    @model_validator(mode="after")
    def _distinct_ports(self) -> "ServingConfig":
        if self.ports[0] == self.ports[1]:
            raise ValueError("ports must be two different ports (blue, green)")
        return self


class MonitoringConfig(_Strict):
    """Prometheus export of the training jobs: one endpoint per job (`monitoring.prometheus`),
    listed for Prometheus in a file_sd target file."""

    enabled: bool = True
    host: str = "127.0.0.1"  # the exporter's bind address; 0.0.0.0 when workers run on other nodes
    port: int = Field(0, ge=0, le=65535)  # 0: any free port (the target file says which)
    advertise_host: str | None = None  # the address workers and Prometheus use; None: host
    targets_dir: Path | None = None  # None: <output_dir>/prometheus-targets
    linger_on_failure_s: float = Field(15.0, ge=0)  # keep a failed job's endpoint up so alerts can fire


class TrackingConfig(_Strict):
    """MLflow. `tracking_uri` None means $MLFLOW_TRACKING_URI, else SQLite in the cwd."""

    tracking_uri: str | None = None
    experiment: str = "rlhf-pipeline"


class PipelineConfig(_Strict):
    name: str = "demo"
    output_dir: Path = Path("runs")
    data: DataConfig = DataConfig()
    validation: ValidationConfig = ValidationConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = ModelConfig()
    sft: SFTConfig = SFTConfig()
    reward: RewardConfig = RewardConfig()
    policy: PolicyConfig = PolicyConfig()
    gates: GateConfig = GateConfig()
    serving: ServingConfig = ServingConfig()
    monitoring: MonitoringConfig = MonitoringConfig()
    tracking: TrackingConfig = TrackingConfig()


_MESSAGES = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "extra_forbidden": "unknown key",
    "missing": "required key is missing",
}


def _describe(err: dict[str, Any]) -> str:
    path = ".".join(str(p) for p in err["loc"]) or "<root>"
    kind = err["type"]
    if kind in _MESSAGES:
        ctx = {k: f"{v:g}" if isinstance(v, float) else v for k, v in err.get("ctx", {}).items()}
        msg = _MESSAGES[kind].format(**ctx)
    else:
        msg = err["msg"].removeprefix("Value error, ")
    if kind not in ("missing", "extra_forbidden") and err["loc"]:
        msg += f", got {err['input']!r}"
    return f"{path}: {msg}"


def parse_config(raw: dict[str, Any] | None, source: str = "config") -> PipelineConfig:
    """Validate a plain dict into a `PipelineConfig`, or raise `ConfigError` naming every bad key."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([f"<root>: must be a mapping, got {type(raw).__name__}"], source)
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError([_describe(e) for e in exc.errors()], source) from None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict, returning a copy."""
    out = yaml.safe_load(yaml.safe_dump(raw)) or {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError([f"override {item!r}: expected key.path=value"])
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError([f"{key}: {part} is not a mapping"])
        node[parts[-1]] = yaml.safe_load(value)
    return out


def load_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Load, override and validate a pipeline config from a YAML file."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError([f"file not found: {path}"], str(path)) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"not valid YAML: {exc}"], str(path)) from None
    return parse_config(apply_overrides(raw, overrides or []), source=str(path))
