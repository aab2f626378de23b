import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlhf_core.config import ModelConfig
from rlhf_core.data.pairs import encode_pair_text, tokenize_pairs
from rlhf_core.models.llama import build_policy, save_pretrained_atomic
from rlhf_core.models.reward import (
    RewardStats,
    load_reward_model,
    normalise,
    read_reward_meta,
    reward_model_from_base,
    reward_stats,
    save_reward_model,
    score,
    score_pairs,
)
from rlhf_core.tokenizer import train_tokenizer

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2)
PROMPTS = ["12+7=", "3+4=", "25+25=", "9+9="]
RESPONSES = ["19", "7", "50", "1234567"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tok = train_tokenizer([f"{a}+{b}={a + b}" for a in range(30) for b in range(30)], vocab_size=300)
    policy = build_policy(TINY, tok, seed=0)
    path = save_pretrained_atomic(policy, tok, tmp_path_factory.mktemp("base") / "sft")
    return path, policy, tok


@pytest.fixture(scope="module")
def reward_model(base):
    return reward_model_from_base(base[0], seed=0).eval()


def test_backbone_comes_from_the_policy_and_the_head_is_scalar(base, reward_model):
    _, policy, _ = base
    for name, p in policy.model.named_parameters():
        torch.testing.assert_close(reward_model.model.get_parameter(name), p, rtol=0, atol=0)
    assert reward_model.score.weight.shape == (1, TINY.hidden_size) and reward_model.score.bias is None
    torch.manual_seed(123)
    again = reward_model_from_base(base[0], seed=0)
    torch.testing.assert_close(again.score.weight, reward_model.score.weight, rtol=0, atol=0)  # seeded head


def test_score_reads_the_last_real_token(base, reward_model):
    _, _, tok = base
    ids = torch.tensor([encode_pair_text(tok, "25+25=", "50")])  # (1, L), no padding
    hidden = reward_model.model(input_ids=ids).last_hidden_state  # (1, L, C)
    expected = hidden[0, -1] @ reward_model.score.weight[0]
    got = score(reward_model, tok, ["25+25="], ["50"], max_length=32)
    assert got.shape == (1,)
    torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-6)


def test_padding_changes_nothing(base, reward_model):
    _, _, tok = base
    batched = score(reward_model, tok, PROMPTS, RESPONSES, max_length=32)  # short rows right padded
    alone = torch.cat([score(reward_model, tok, [p], [r], max_length=32) for p, r in zip(PROMPTS, RESPONSES)])
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-6)
    small_batches = score(reward_model, tok, PROMPTS, RESPONSES, max_length=32, batch_size=3)
    torch.testing.assert_close(small_batches, batched, rtol=1e-5, atol=1e-6)


def test_scores_under_bf16_autocast_come_back_float32_near_the_fp32_ones(base, reward_model):
    """The policy stage scores in its trainer's precision (`computing_in`): under bf16 autocast
    the scores are float32 tensors within bf16's rounding of the fp32 ones."""
    from rlhf_core.training.precision import computing_in

    _, _, tok = base
    fp32 = score(reward_model, tok, PROMPTS, RESPONSES, max_length=32)
    with computing_in("bf16"):
        bf16 = score(reward_model, tok, PROMPTS, RESPONSES, max_length=32)
    assert bf16.dtype == torch.float32 and bf16.shape == fp32.shape
    assert not torch.equal(bf16, fp32)  # computed in bf16, not passed through
    torch.testing.assert_close(bf16, fp32, rtol=0.02, atol=0.01 * float(fp32.abs().max()))


def test_frozen_layers_keep_their_weights_out_of_the_backward_pass(base):
    """`reward.frozen_layers`: the embeddings and the lowest N layers get no gradient; the rest
    and the head do. More layers than the backbone has is refused, naming both numbers."""
    from rlhf_core.models.reward import freeze_lower_layers

    path, _, tok = base
    model = freeze_lower_layers(reward_model_from_base(path, seed=0), 1)
    ids = torch.tensor([encode_pair_text(tok, "25+25=", "50")])
    model(input_ids=ids).logits.sum().backward()
    frozen = {n for n, p in model.named_parameters() if p.grad is None}
    assert frozen == {n for n, _ in model.named_parameters() if n.startswith(("model.embed_tokens.", "model.layers.0."))}
    assert all(not p.requires_grad for n, p in model.named_parameters() if n in frozen)
    assert model.model.layers[1].self_attn.q_proj.weight.grad is not None and model.score.weight.grad is not None
    untouched = freeze_lower_layers(reward_model_from_base(path, seed=0), 0)
    assert all(p.requires_grad for p in untouched.parameters())
    with pytest.raises(ValueError, match="reward.frozen_layers is 3 but the backbone has 2 decoder layers"):
        freeze_lower_layers(untouched, 3)
    from transformers import GPT2Config, GPT2ForSequenceClassification  # names its layers `h`

    gpt2 = GPT2ForSequenceClassification(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, pad_token_id=0))
    assert freeze_lower_layers(gpt2, 0) is gpt2 and all(p.requires_grad for p in gpt2.parameters())
    with pytest.raises(ValueError, match="GPT2ForSequenceClassification has no decoder layers to freeze"):
        freeze_lower_layers(gpt2, 1)


def test_max_length_cuts_the_text(base, reward_model):
    _, _, tok = base
    full = encode_pair_text(tok, "9+9=", "1234567")
    cut = score(reward_model, tok, ["9+9="], ["1234567"], max_length=8)
    with torch.no_grad():
        expected = reward_model(input_ids=torch.tensor([full[:8]])).logits[0, 0]
    torch.testing.assert_close(cut[0], expected, rtol=1e-5, atol=1e-6)


def test_stats_and_normalise_closed_form():
    stats = reward_stats(torch.tensor([1.0, 3.0, 5.0, 7.0]))
    assert stats.mean == pytest.approx(4.0) and stats.std == pytest.approx(5.0**0.5)
    torch.testing.assert_close(normalise(torch.tensor([4.0, 4.0 + 5.0**0.5]), stats), torch.tensor([0.0, 1.0]))
    assert reward_stats(torch.tensor([2.0, 2.0])) == RewardStats(2.0, 1.0)
    with pytest.raises(ValueError, match="empty"):
        reward_stats(torch.zeros(0))


def test_saved_model_loads_with_auto_class_and_scores_the_same(base, reward_model, tmp_path):
    _, _, tok = base
    before = score(reward_model, tok, PROMPTS, RESPONSES, max_length=32)
    out = save_reward_model(reward_model, tok, tmp_path / "rm", RewardStats(0.5, 2.0), extra={"eval_accuracy": 0.9})
    assert (out / "model.safetensors").is_file()
    assert read_reward_meta(out) == {"stage": "reward", "eval_accuracy": 0.9, "reward_mean": 0.5, "reward_std": 2.0}
    loaded = AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    assert type(loaded).__name__ == "LlamaForSequenceClassification" and loaded.config.num_labels == 1
    after = score(loaded, AutoTokenizer.from_pretrained(str(out)), PROMPTS, RESPONSES, max_length=32)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    model, tok2, stats = load_reward_model(out)
    assert stats == RewardStats(0.5, 2.0)
    torch.testing.assert_close(score(model, tok2, PROMPTS, RESPONSES, max_length=32), before, rtol=0, atol=0)


def test_score_pairs_matches_score_on_both_sides(base, reward_model):
    _, _, tok = base
    rows = [{"prompt": p, "chosen": r, "rejected": r[::-1] + "1"} for p, r in zip(PROMPTS, RESPONSES)]
    pairs = tokenize_pairs(rows, tok, max_length=32)
    r_chosen, r_rejected = score_pairs(reward_model, pairs, batch_size=3)
    torch.testing.assert_close(r_chosen, score(reward_model, tok, PROMPTS, RESPONSES, 32), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        r_rejected, score(reward_model, tok, PROMPTS, [r["rejected"] for r in rows], 32), rtol=1e-5, atol=1e-6
    )


def test_the_audit_that_judges_a_policy_is_the_one_its_rounds_kept_current(tmp_path):
    from rlhf_core.models.reward import AUDIT_DIR, META_FILE, current_audit_dir

    policy, reward = tmp_path / "policy", tmp_path / "reward"
    assert current_audit_dir(policy, reward) is None  # neither stage kept one
    (reward / AUDIT_DIR).mkdir(parents=True)
    (reward / AUDIT_DIR / META_FILE).write_text("{}")
    assert current_audit_dir(policy, reward) == reward / AUDIT_DIR
    assert current_audit_dir(None, reward) == reward / AUDIT_DIR
    (policy / AUDIT_DIR).mkdir(parents=True)
    assert current_audit_dir(policy, reward) == reward / AUDIT_DIR  # a directory without its meta is no model
    (policy / AUDIT_DIR / META_FILE).write_text("{}")
    assert current_audit_dir(policy, reward) == policy / AUDIT_DIR
