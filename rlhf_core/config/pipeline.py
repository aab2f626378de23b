"""The pipeline's configuration: one validated config per stage, composed by `PipelineConfig`.

`PipelineConfig` is loaded from one YAML file (`configs/demo.yaml` is the embedded default). Unknown keys, wrong types and
out-of-range values are rejected before anything runs, with the key path in the message:

    policy.ppo.clip_range: must be > 0, got -1
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlhf_core.config.inputs import (  # noqa: F401 - re-exported by the package
    Checker, DataConfig, DemoDataConfig, ModelConfig, TokenizerConfig, ValidationConfig, _Strict,
)
from rlhf_core.config.offline import (  # noqa: F401 - re-exported by the package
    DPOConfig, KTOConfig, LoRAConfig, OfflineTrainingConfig,
)
from rlhf_core.config.policy import (  # noqa: F401 - re-exported by the package
    CircuitBreakerConfig, GRPOConfig, JudgeConfig, PolicyConfig, PPOConfig, RewardShapingConfig,
    RolloutPipelineConfig, RoundsConfig,
)


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
    frozen_layers: int = Field(0, ge=0, description=(
        "The embeddings and the lowest N decoder layers keep the backbone's weights: the backward pass stops above "
        "them, and gradients and AdamW state are held for the rest only (SmolLM2-135M with 15 of its 30 layers "
        "frozen: a step about half as long). 0: every weight trains."))
    micro_batch_size: int = Field(32, ge=1, description='Pairs per forward/backward on one worker.')
    grad_accum_steps: int = Field(1, ge=1, description='Micro-batches accumulated per optimizer step.')
    epochs: int = Field(4, ge=1, description='Passes over the training pairs.')
    learning_rate: float = Field(3e-4, gt=0, description='Peak learning rate, reached after the warm-up.')
    weight_decay: float = Field(0.0, ge=0, description='AdamW weight decay.')
    warmup_steps: int = Field(10, ge=0, description='Optimizer steps of linear learning-rate warm-up.')
    max_grad_norm: float = Field(1.0, gt=0, description='Gradients are clipped to this global norm.')
    precision: Literal["auto", "fp32", "bf16"] = Field("fp32", description=(
        "What the training passes compute in: bf16 (mixed precision: weights, gradients and optimizer state stay "
        "fp32) or fp32; auto: bf16 on a GPU that supports it, and on a CPU where a bf16 matrix multiply measures at "
        "least 1.3x as fast as fp32, else fp32. The held-out evaluation and the saved scores are fp32 either way."))
    max_length: int = Field(32, ge=4, description='Longest scored sequence in tokens (prompt + response + </s>).')
    on_overlength: Literal["truncate", "reject"] = Field(
        "truncate", description='A longer pair is cut to max_length (truncate) or fails the stage naming the rows (reject).')
    margin: float = Field(
        0.0, description='Margin by which the chosen reward should exceed the rejected one in the Bradley-Terry loss.')
    eval_share: float = Field(0.1, gt=0, lt=1, description='Held-out share of the pairs, split by prompt.')
    checkpoint_every: int = Field(20, ge=1, description='Optimizer steps between checkpoints.')
    max_failures: int = Field(2, ge=0,
        description='Worker failures the run survives by resuming from its last checkpoint.')
    min_eval_accuracy: float = Field(0.6, ge=0, le=1,
        description='The stage fails when held-out pairwise accuracy is below this (a reward model that '
        'learned nothing scores about 0.5; on people\'s preferences working ones score 0.6-0.75).')
    ensemble_size: int = Field(1, ge=1, le=16, description=(
        'Reward-model ensemble members: score heads on one backbone, each trained on its own Poisson '
        'bootstrap of the pairs (1: one plain reward model). The policy combines them by policy.shaping.aggregate.'))
    audit_share: float = Field(0.0, ge=0, lt=1, description=(
        'Share of the training pairs (split by prompt) held back to train a separate audit reward model, '
        'which the policy never trains against; it is measured on every step and judged by the gates. 0: no audit.'))

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_workers * self.grad_accum_steps


class RegressionSuiteConfig(_Strict):
    """One regression suite (`rlhf_core.eval.regression`): prompts with their answers that the base
    model already gets right, unrelated to the training task. A candidate whose accuracy on them
    drops by more than `margin` below the reference's or the champion's is rejected."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="Names the suite in the gate's checks and reasons "
        "(regression:<name>) and in the metrics.")
    path: str = Field(description='JSONL file of {"prompt": ..., "answer": ...} rows; or demo:<suite>, a suite '
        "the demo generates into the run's data directory (demo:no_carry, rlhf_core.data.synthetic.no_carry_suite).")
    checker: Checker = Field("answer_exact_match", description="Decides whether an answer is right: a verifiable reward "
        "registered in rlhf_core.training.verifiable.VERIFIABLE_REWARDS, or module:function.")
    margin: float = Field(0.05, ge=0, le=1, description="Largest allowed drop in accuracy on the suite.")
    rows: int | None = Field(None, ge=1, description="Rows of the first look; null: a file's every row, 200 of a "
        "demo suite.")
    max_rows: int | None = Field(None, ge=1, description="With gates.confidence, the most rows the suite may be "
        "answered on: a comparison still undecided is answered on twice the rows, look by look up to this "
        "budget, with the error rate spent across the looks (rlhf_core.eval.sequential); null: rows (one look).")

    @model_validator(mode="after")
    def _budget_covers_first_look(self) -> "RegressionSuiteConfig":
        if self.rows is not None and self.max_rows is not None and self.max_rows < self.rows:
            raise ValueError(f"regression suite {self.name}: max_rows ({self.max_rows}) is below rows ({self.rows})")
        return self


class GateConfig(_Strict):
    """Promotion gates on held-out prompts (`rlhf_core.eval.gates.gate`): a trained policy
    replaces the champion only when every check passes (and `auto_promote` is on)."""

    eval_prompts: int = Field(200, ge=1, description="Held-out prompts of the gates' first look (the eval set's first rows).")
    max_eval_prompts: int | None = Field(None, ge=1, description=(
        "With gates.confidence, the most held-out prompts the gates may look at: while a call on them is undecided "
        "(accuracy, win rates, audit checks), every policy answers twice the prompts, look by look up to this "
        "budget or the eval set's last row, with the error rate spent across the looks (rlhf_core.eval.sequential); "
        "null: eval_prompts (one look)."))
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
    max_proxy_audit_gap: float | None = Field(0.08, gt=0, le=1, description=(
        "Largest amount by which the candidate's win rate against the reference under the reward model it "
        "trained on may exceed its win rate under the audit model; skipped without an audit model; null: not "
        "checked."))
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
    regression_suites: list[RegressionSuiteConfig] = Field([], description=(
        "Regression suites: small eval sets of what the base model already does right, unrelated to the task. "
        "Each is {name: letters, digits, _.-; path: a JSONL file of {prompt, answer} rows, or demo:no_carry, "
        "generated by the demo; checker: a verifiable reward's name (default answer_exact_match) or "
        "module:function; margin: the largest allowed accuracy drop, default 0.05; rows: the first look, default "
        "every row of a file, 200 of a demo suite; max_rows: the most rows a call still open is looked at on, "
        "default rows}. Every policy answers them "
        "greedily; a candidate whose accuracy difference to the reference or the champion is worse than -margin "
        "(judged like accuracy_vs_champion) is rejected as regression:<name>. The files are checked before "
        "anything trains (docs/pipeline.md)."))

    @model_validator(mode="after")
    def _eval_budget_covers_first_look(self) -> "GateConfig":
        if self.max_eval_prompts is not None and self.max_eval_prompts < self.eval_prompts:
            raise ValueError(f"gates.max_eval_prompts ({self.max_eval_prompts}) is below gates.eval_prompts "
                             f"({self.eval_prompts})")
        return self

    @field_validator("regression_suites")
    @classmethod
    def _suite_names_unique(cls, suites: list[RegressionSuiteConfig]) -> list[RegressionSuiteConfig]:
        names = [s.name for s in suites]
        if len(set(names)) < len(names):
            raise ValueError(f"regression suite names must be unique, got {names}")
        return suites


class CanaryConfig(_Strict):
    """A candidate served to a share of the users beside the champion until their thumbs decide
    (`rlhf_core.serving.canary`, docs/operations.md "Canary")."""

    enabled: bool = Field(False, description="A version the pipeline promotes starts as a canary instead of "
        "replacing the champion at once (also `rlhf canary start VERSION`).")
    share: float = Field(0.1, gt=0, lt=1, description="Share of the users the canary serves, sticky per user.")
    margin: float = Field(0.05, gt=0, lt=1, description="The canary is promoted once its thumbs-up rate is "
        "surely no more than this below the champion's, rolled back once it is surely more.")
    alpha: float = Field(0.05, gt=0, lt=0.5, description="Error rate of the always-valid test (rlhf_core.eval."
        "always_valid): a wrong promotion, or a wrong roll-back, each at most about alpha/2 of the time.")
    min_ratings: int = Field(100, ge=1, description="Thumbs of each version before any call.")
    max_ratings: int = Field(20_000, ge=2, description="Thumbs of both together at which a call still open rolls back.")
    max_hours: float = Field(168.0, gt=0, description="Hours after which a call still open rolls back.")
    guard_margin: float = Field(0.1, gt=0, lt=1, description="Counter-metrics on the canary's answers: it is "
        "rolled back once its share of answers that are not refusals, or that do not give in to a user's "
        "pushback, is surely more than this below the champion's (rlhf_core.eval.behaviour's checkers).")
    max_length_ratio: float = Field(1.5, gt=0, description="The canary is rolled back once its mean answer "
        "length is more than this times the champion's, with min_ratings answers of each.")


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
        30.0, ge=0, description="After a switch, the previous server stops taking requests (503, or a refused "
        "connection) and is stopped once it has answered every request it accepted, or after this many seconds "
        "(what it has not answered by then is aborted).")
    extra_args: list[str] = Field([], description='Passed on to vllm.entrypoints.openai.api_server.')
    canary: CanaryConfig = CanaryConfig()

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
    user_secret_env: str = Field(
        "RLHF_USER_SIGNING_SECRET", description="Environment variable that, when set and non-empty, holds the "
        "user-signing secret: the application in front of the gateway signs each user id with it (HMAC-SHA256, "
        "headers x-user-id and x-user-signature), and feedback counts only for signed users. Unset: <serving "
        "state_dir>/user_signing_secret, generated (mode 0600) on first use. Gateways behind one application must "
        "share it.")
    admin_key_env: str = Field(
        "RLHF_GATEWAY_ADMIN_KEY", description="Environment variable that, when set and non-empty, holds the admin key "
        "(header x-admin-key), which may delete any user's data; a user may delete only their own. Unset: <serving "
        "state_dir>/admin_key, generated (mode 0600) on first use.")
    unsigned_ratings: Literal["refuse", "anonymous"] = Field(
        "refuse", description='Feedback without a validly signed user: "refuse" answers 401; "anonymous" records it '
        "as one anonymous user (an unsigned x-user-id or body user is ignored), whose ratings share one rate limit.")
    ratings_per_minute: int = Field(
        60, ge=1, description="Feedback one signed user, or all anonymous feedback together, may send per minute; "
        "more is refused (429) and counted.")
    max_feedback_bytes: int = Field(
        64 * 1024, ge=1, description="Largest body of POST /v1/feedback, in bytes; a larger one is refused (413) "
        "before it is parsed.")
    max_completion_bytes: int = Field(
        1024 * 1024, ge=1, description="Largest body of a completion or chat completion request, in bytes; a larger "
        "one is refused (413) and never reaches the served model.")
    max_samples: int = Field(4, ge=1, le=16, description="Largest n a client may ask for (answers to choose between).")
    upstream_timeout_s: float = Field(120.0, gt=0, description="Seconds the gateway waits for the served model.")
    export_dir: Path | None = Field(
        None, description="Where collect-feedback writes its datasets; null: <output_dir>/feedback.")
    settle_s: float = Field(
        5.0, ge=0, description="An export covers feedback older than this many seconds, so that a write still "
        "in flight when the export starts falls into the next one.")
    max_user_share: float = Field(
        0.2, gt=0, le=1, description="Most of an export's feedback one user may give: beyond it (and beyond "
        "min_user_flood items) a user's later items are left out of it.")
    min_user_flood: int = Field(20, ge=1, description="Items from one user that max_user_share never cuts.")
    max_burst: int = Field(20, ge=1, description="Most feedback items one user may give in burst_window_s seconds; "
                           "faster ones are left out of the export as a burst.")
    burst_window_s: float = Field(60.0, gt=0, description="The window of max_burst, in seconds.")
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
    registered_model: str = Field("policy", min_length=1, description=(
        "The registry's name for the policies this config trains; its aliases champion and challenger say what "
        "serves and what waits for review. Configs that train different models on one tracking server need "
        "different names, else one model's candidate is judged against, and replaces, the other's champion."))
    registered_reward_model: str = Field("reward-model", min_length=1, description=(
        "The registry's name for the reward models this config trains (a policy version's lineage names one)."))


class PipelineConfig(_Strict):
    """The whole pipeline: one section per stage, loaded from one YAML file."""

    name: str = Field("rlhf", description="Name of the run; the run's MLflow name and output directory start with it.")
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
    def _frozen_layers_within_the_demo_model(self) -> "PipelineConfig":
        built = self.model.pretrained is None and self.reward.base_model is None  # the pipeline builds the backbone
        if built and self.reward.frozen_layers > self.model.num_layers:
            raise ValueError(f"reward.frozen_layers is {self.reward.frozen_layers} but the model has "
                             f"{self.model.num_layers} layers (model.num_layers)")
        return self

    @model_validator(mode="after")
    def _sft_off_needs_a_pretrained_model(self) -> "PipelineConfig":
        if not self.sft.enabled and self.model.pretrained is None:
            raise ValueError("sft.enabled is false but model.pretrained is not set: there is no base policy")
        return self
