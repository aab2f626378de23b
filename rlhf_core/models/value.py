"""The PPO critic: a decoder backbone of any family with a scalar value head at every token.

`TokenValueModel(input_ids, attention_mask) -> values (B, L)`: V(s_t) for the state that ends
at token t, i.e. the value used to predict token t + 1 (the same position whose logits give
log pi(y_{t+1} | ...)).

`value_model_from(path)` takes the backbone of any Hugging Face checkpoint that
`AutoModel` reads (Llama, Qwen2, Mistral, Gemma, ...): the SFT policy (`*ForCausalLM`) or
the reward model (`*ForSequenceClassification`); transformers drops their heads and keeps
the base model. The value head starts at zero, so the critic's first predictions are 0 and
the first advantages are the plain discounted rewards.
Departure from InstructGPT (critic initialised from the reward model, head included): with
normalised rewards a zero head is a better-calibrated start than the RM's raw scale.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoModel, PretrainedConfig, PreTrainedModel


class TokenValueModel(nn.Module):
    """A Hugging Face base model (no LM head) + Linear(hidden, 1) on every position."""

    def __init__(self, backbone: PreTrainedModel):
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config
        self.value_head = nn.Linear(hidden_size(backbone.config), 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, attention_mask: (B, L) -> values (B, L) float32."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, L, H)
        return self.value_head(hidden).squeeze(-1).float()  # (B, L)


def hidden_size(config: PretrainedConfig) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text.hidden_size


def _zero_head(model: TokenValueModel) -> TokenValueModel:
    with torch.no_grad():
        model.value_head.weight.zero_()
        model.value_head.bias.zero_()
    return model


def value_model_from(path: Path | str) -> TokenValueModel:
    """A critic whose backbone is the checkpoint at `path` (policy or reward model) and whose
    value head is zero."""
    return _zero_head(TokenValueModel(AutoModel.from_pretrained(str(path), dtype=torch.float32)))


def value_model_from_config(config: PretrainedConfig) -> TokenValueModel:
    """A critic with a freshly initialised backbone of `config`'s family and a zero head."""
    return _zero_head(TokenValueModel(AutoModel.from_config(config)))
