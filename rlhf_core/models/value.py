"""The PPO critic: a Llama backbone with a scalar value head at every token.

`LlamaForTokenValue(input_ids, attention_mask) -> values (B, L)`: V(s_t) for the state that
ends at token t, i.e. the value used to predict token t + 1 (the same position whose logits
give log pi(y_{t+1} | ...)). It is a `LlamaPreTrainedModel`, so it saves and loads with
`save_pretrained` / `from_pretrained` (safetensors + config.json).

`value_model_from(path)` initialises the backbone from any Llama checkpoint in HF format,
the SFT policy (`LlamaForCausalLM`) or the reward model (`LlamaForSequenceClassification`):
both keep the backbone under `model.`. The value head starts at zero, so the critic's
first predictions are 0 and the first advantages are the plain discounted rewards.
Departure from InstructGPT (critic initialised from the reward model, head included): with
normalised rewards a zero head is a better-calibrated start than the RM's raw scale.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import LlamaModel, LlamaPreTrainedModel

from rlhf_core.models.llama import save_pretrained_atomic


class LlamaForTokenValue(LlamaPreTrainedModel):
    """Llama backbone + Linear(hidden, 1) on every position."""

    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.value_head = nn.Linear(config.hidden_size, 1)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, attention_mask: (B, L) -> values (B, L) float32."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, L, H)
        return self.value_head(hidden).squeeze(-1).float()  # (B, L)


def value_model_from(path: Path | str) -> LlamaForTokenValue:
    """A critic whose backbone is the Llama checkpoint at `path` (policy or reward model) and
    whose value head is zero."""
    model = LlamaForTokenValue.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        model.value_head.weight.zero_()
        model.value_head.bias.zero_()
    return model


def save_value_model(model: LlamaForTokenValue, tokenizer, out_dir: Path) -> Path:
    """HF directory (safetensors + tokenizer), loadable with `LlamaForTokenValue.from_pretrained`."""
    return save_pretrained_atomic(model, tokenizer, out_dir, extra={"stage": "critic"})
