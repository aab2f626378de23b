import math

import torch

from rlhf_core.training.sft import IGNORE_INDEX, completion_loss, encode_sft_batch, warmup_cosine
from rlhf_core.tokenizer import train_tokenizer


def test_labels_cover_completion_and_eos_only():
    tok = train_tokenizer(["12+7=19", "3+4=7"], vocab_size=300)
    batch = encode_sft_batch(tok, ["12+7=", "3+4="], ["19", "7"])
    # row 0: <s> 1 2 + 7 = | 1 9 </s>
    assert batch.input_ids.shape == (2, 9)
    labelled = [tok.convert_ids_to_tokens([t for t in row.tolist() if t != IGNORE_INDEX]) for row in batch.labels]
    assert labelled == [["1", "9", "</s>"], ["7", "</s>"]]
    assert batch.attention_mask.sum(1).tolist() == [9, 7]
    assert (batch.input_ids[1, 7:] == tok.pad_token_id).all()


def test_completion_loss_is_mean_cross_entropy_over_labelled_next_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5, dtype=torch.float64)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 1], [IGNORE_INDEX, 2, IGNORE_INDEX, IGNORE_INDEX]])
    # position t predicts labels[t+1]: (0,1)->3, (0,2)->1, (1,0)->2
    terms = [-torch.log_softmax(logits[b, t], -1)[y] for b, t, y in [(0, 1, 3), (0, 2, 1), (1, 0, 2)]]
    torch.testing.assert_close(completion_loss(logits, labels), torch.stack(terms).mean())


def test_warmup_cosine_schedule_closed_form():
    assert warmup_cosine(0, 100, 10) == 0.1
    assert warmup_cosine(9, 100, 10) == 1.0
    assert warmup_cosine(10, 100, 10) == 1.0
    assert math.isclose(warmup_cosine(55, 100, 10), 0.1 + 0.9 * 0.5)
    assert math.isclose(warmup_cosine(100, 100, 10), 0.1)
