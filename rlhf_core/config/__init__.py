"""The pipeline's configuration, one module per part:

- `pipeline`: `PipelineConfig` and the stage configs it composes (SFT, reward, gates, serving,
  feedback, tracking);
- `inputs`: data, the demo task, the model, the tokenizer, the data contract;
- `policy`: policy optimisation (PPO, GRPO, rounds, shaping, the circuit breaker);
- `offline`: DPO, KTO and LoRA;
- `loading`: YAML files with `base:` overlays and `--set` overrides into a validated config,
  every bad key named in one `ConfigError`;
- `doc`: docs/configuration.md, generated from the models (`python -m rlhf_core.config.doc`);
- `default`: where the embedded demo config lives.

Callers import what they need from the package: `from rlhf_core.config import load_config, PolicyConfig`.
"""
from rlhf_core.config.inputs import (
    DataConfig, DemoDataConfig, ModelConfig, TokenizerConfig, ValidationConfig, _Strict,
)
from rlhf_core.config.loading import ConfigError, apply_overrides, config_origins, load_config, parse_config
from rlhf_core.config.offline import DPOConfig, KTOConfig, LoRAConfig, OfflineTrainingConfig
from rlhf_core.config.pipeline import (
    CanaryConfig, FeedbackConfig, GateConfig, MonitoringConfig, PipelineConfig, RegressionSuiteConfig, RewardConfig, ServingConfig,
    SFTConfig, TrackingConfig,
)
from rlhf_core.config.policy import (
    CircuitBreakerConfig, GRPOConfig, JudgeConfig, PolicyConfig, PPOConfig, RewardShapingConfig,
    RolloutEngineConfig, RolloutPipelineConfig, RoundsConfig,
)

__all__ = [
    "CircuitBreakerConfig", "ConfigError", "DPOConfig", "DataConfig", "DemoDataConfig", "FeedbackConfig", "GRPOConfig",
    "CanaryConfig", "GateConfig", "JudgeConfig", "KTOConfig", "LoRAConfig", "ModelConfig", "MonitoringConfig", "OfflineTrainingConfig",
    "PPOConfig", "PipelineConfig", "PolicyConfig", "RegressionSuiteConfig", "RewardConfig", "RewardShapingConfig",
    "RolloutEngineConfig", "RolloutPipelineConfig", "RoundsConfig", "SFTConfig", "ServingConfig", "TokenizerConfig", "TrackingConfig",
    "ValidationConfig", "_Strict", "apply_overrides", "config_origins", "load_config", "parse_config",
]
