"""The tiny pipeline config the tests and benchmarks run every stage with."""
from __future__ import annotations

from pathlib import Path


def tiny_config_dict(tmp: Path) -> dict:
    """A pipeline config small enough to run every stage in seconds (accuracy is not the point).

    It sets every key that configs/demo.yaml sets (the bars off), so that the demo config with
    these values as overrides is this config: the deployment tests run it that way."""
    return {
        "name": "test",
        "output_dir": str(tmp / "runs"),
        "data": {"demo": {"seed": 0, "n_sft": 240, "n_pairs": 200, "n_eval": 24, "n_eval_reserve": 0}},
        # head size 32: the smallest that vLLM's CPU attention supports
        "model": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2,
                  "initializer_range": 0.02},
        "sft": {"epochs": 1, "batch_size": 32, "warmup_steps": 2, "min_eval_accuracy": 0.0},
        # one reward model on one worker, no audit, no defences, no rounds, the answer key in the
        # reward: the tests that want them set them (a second worker only adds its start-up to a
        # test about something else; the deployed demo run in tests/flows/test_pipeline_flow.py
        # trains on two)
        "reward": {"num_workers": 1, "micro_batch_size": 16, "epochs": 1, "checkpoint_every": 4,
                   "min_eval_accuracy": 0.0, "warmup_steps": 2, "ensemble_size": 1, "audit_share": 0.0},
        "policy": {"algorithm": "grpo", "num_workers": 1, "precision": "fp32", "steps": 2, "prompts_per_step": 8,
                   "max_new_tokens": 4,
                   "minibatch_size": 32, "micro_batch_size": 32, "eval_every": 2, "checkpoint_every": 2,
                   "min_accuracy_gain": 0.0, "reward_model_weight": 0.25, "verifiable_reward_weight": 1.0,
                   "verifiable_reward": "addition_exact_match",
                   "kl_coef": 0.02, "shaping": {"aggregate": "mean", "bounded": False, "length_penalty": 0.0},
                   "rounds": {"enabled": False, "every": 10, "prompts": 64, "learning_rate": 1e-4},
                   "grpo": {"group_size": 4, "scale_by_std": True}},
        "gates": {"regression_suites": [], "max_eval_prompts": None},  # the tests that want them set them
        "tracking": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "tests"},
    }
