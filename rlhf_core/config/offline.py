"""The configs of the offline policy methods (DPO / IPO, KTO) and of LoRA adapters: sections
of `policy` (`policy.dpo`, `policy.kto`, `policy.lora`), re-exported by `rlhf_core.config`."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_core.config.inputs import _Strict


class LoRAConfig(_Strict):
    """LoRA adapters on the policy (`peft`): the base weights stay frozen and only low-rank
    adapters train, so the optimizer holds state for the adapters alone and the reference policy
    is the same model with its adapters off (no second copy). The model that leaves the stage has
    the adapters merged into its weights. In PPO and GRPO the rollout engine receives the merged
    weights after each update; the critic (PPO) trains every weight."""

    enabled: bool = Field(False, description='Train LoRA adapters instead of every weight.')
    rank: int = Field(8, ge=1, description='Rank of each adapter (r).')
    alpha: float = Field(16.0, gt=0, description='Scale of the adapters: their update is multiplied by alpha / rank.')
    dropout: float = Field(0.0, ge=0, lt=1, description='Dropout on the adapters\' input.')
    target_modules: str | list[str] = Field(
        "all-linear", description="Names of the modules that get adapters (e.g. [q_proj, v_proj]), or all-linear: "
                                  "every linear layer but the output head. A name that matches no module is an error.")


class OfflineTrainingConfig(_Strict):
    """What the offline policy methods (DPO, IPO, KTO) train with: passes over the data,
    batches, learning rate, sequence length."""

    epochs: int = Field(2, ge=1, description='Passes over the training data.')
    batch_size: int = Field(64, ge=1, description='Pairs (DPO) or examples (KTO) per optimizer step, all workers together.')
    micro_batch_size: int = Field(16, ge=1, description='Pairs or examples per forward/backward on one worker.')
    learning_rate: float = Field(5e-5, gt=0, description='Peak learning rate, reached after the warm-up.')
    warmup_steps: int = Field(5, ge=0, description='Optimizer steps of linear learning-rate warm-up.')
    max_length: int = Field(64, ge=2, description='Longest prompt + response, in tokens.')
    on_overlength: Literal["truncate", "reject"] = Field(
        "truncate", description="Longer than max_length: cut the response's tail, or refuse the data.")


class DPOConfig(OfflineTrainingConfig):
    """DPO, or its IPO variant (`policy.algorithm: dpo`): the policy learns from the preference
    pairs directly, against the frozen SFT policy as reference; no rollouts, and no reward model
    in training (the gates still use one to compare candidates). Trains on the same pairs the
    reward model trains on (its held-out prompts stay out). One optimizer step takes
    `batch_size` pairs, all workers together, in micro-batches of `micro_batch_size` pairs."""

    loss_type: Literal["sigmoid", "ipo"] = Field(
        "sigmoid", description="sigmoid: DPO's loss; ipo: IPO's squared loss on length-averaged log-probs.")
    beta: float = Field(0.1, gt=0, description='Strength of the tie to the reference policy (DPO/IPO beta).')
    label_smoothing: float = Field(0.0, ge=0, lt=0.5,
        description="Share of labels assumed flipped (conservative DPO); sigmoid loss only.")


class KTOConfig(OfflineTrainingConfig):
    """KTO (`policy.algorithm: kto`): the policy learns from unpaired answers labelled desirable
    or undesirable (a thumbs up or down), against the frozen SFT policy as reference. From
    preference data each pair gives one labelled answer, its chosen (desirable) or its rejected
    (undesirable) one, drawn with `desirable_share`, so no prompt keeps both. KTO's reference
    point, the policy's KL to the reference, is estimated on each batch from mismatched
    prompt-answer pairs."""

    beta: float = Field(0.1, gt=0, description='Strength of the tie to the reference policy (KTO beta).')
    desirable_weight: float = Field(1.0, gt=0, description='Weight of the desirable answers in the loss (lambda_D).')
    undesirable_weight: float = Field(1.0, gt=0, description='Weight of the undesirable answers in the loss (lambda_U).')
    desirable_share: float = Field(0.5, gt=0, lt=1,
        description="From preference pairs: the share of pairs that give their chosen answer (the rest their rejected).")
