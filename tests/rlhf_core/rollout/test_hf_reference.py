import torch

from rlhf_core.config import ModelConfig
from rlhf_core.models.llama import build_policy
from rlhf_core.rollout.hf_reference import recompute_logprobs, right_padded
from rlhf_core.tokenizer import train_tokenizer

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2)


def tiny_model():
    tok = train_tokenizer([f"{a:02d}+{b:02d}={a + b:03d}" for a in range(20) for b in range(20)], vocab_size=64)
    return build_policy(TINY, tok, seed=0).eval(), tok


@torch.no_grad()
def one_row_reference(model, prompt, response, temperature):
    """Unbatched, unpadded: log_softmax(logits / T) at the positions that predict the response."""
    ids = torch.tensor([prompt + response])
    logp = torch.log_softmax(model(input_ids=ids).logits[0] / temperature, dim=-1)  # (L, V)
    return torch.stack([logp[len(prompt) - 1 + t, tok] for t, tok in enumerate(response)])


def test_batched_right_padded_logprobs_equal_one_row_at_a_time():
    model, tok = tiny_model()
    prompts = [tok(p)["input_ids"] for p in ["07+48=", "1+2=", "19+19="]]
    responses = [[5, 9, 2], [7], [3, 3, 3, 3, 3, tok.eos_token_id]]  # different lengths -> padding
    for temperature in (1.0, 0.7):
        got = recompute_logprobs(model, prompts, responses, temperature=temperature, batch_size=2)
        assert [g.shape for g in got] == [torch.Size([len(r)]) for r in responses]
        for g, p, r in zip(got, prompts, responses):
            torch.testing.assert_close(g, one_row_reference(model, p, r, temperature), rtol=0, atol=1e-5)


def test_temperature_changes_the_logprobs():
    model, tok = tiny_model()
    prompts, responses = [tok("07+48=")["input_ids"]], [[5, 9, 2]]
    t1 = recompute_logprobs(model, prompts, responses, temperature=1.0)[0]
    t2 = recompute_logprobs(model, prompts, responses, temperature=0.5)[0]
    assert not torch.allclose(t1, t2)


def test_right_padded_masks_exactly_the_real_tokens():
    ids, mask = right_padded([[1, 2], [1]], [[3], [4, 5, 6]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 0], [1, 4, 5, 6]]
    assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
