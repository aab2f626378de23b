"""The critic takes the backbone of any family's checkpoint, policy or reward model."""
import pytest
import torch
from transformers import AutoModelForSequenceClassification

from rlhf_core.models.value import value_model_from


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_the_critic_keeps_the_checkpoints_backbone_and_starts_at_zero(tmp_path, make_pretrained, family):
    path, lm = make_pretrained(tmp_path, family)
    critic = value_model_from(path).eval()
    ids = torch.tensor([[1, 5, 9, 12, 2], [1, 7, 7, 3, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    with torch.no_grad():
        values = critic(ids, mask)
        torch.testing.assert_close(critic.backbone(input_ids=ids, attention_mask=mask).last_hidden_state,
                                   lm.eval().base_model(input_ids=ids, attention_mask=mask).last_hidden_state)
    assert values.shape == (2, 5) and values.dtype == torch.float32
    assert torch.count_nonzero(values) == 0


def test_the_critic_reads_a_reward_models_backbone(tmp_path, make_pretrained):
    path, _ = make_pretrained(tmp_path, "qwen2")
    rm = AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1)
    rm.config.pad_token_id = 0
    rm.save_pretrained(str(tmp_path / "rm"))
    critic = value_model_from(tmp_path / "rm")
    for name, weight in rm.base_model.state_dict().items():
        torch.testing.assert_close(critic.backbone.state_dict()[name], weight, rtol=0, atol=0)
