import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_core.config import ModelConfig
from rlhf_core.models.llama import build_policy, save_pretrained_atomic
from rlhf_core.tokenizer import train_tokenizer

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2)


def tokenizer():
    return train_tokenizer([f"{a}+{b}={a + b}" for a in range(30) for b in range(30)], vocab_size=300)


def test_tokenizer_splits_digits_and_round_trips():
    tok = tokenizer()
    ids = tok("123+45=")["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.convert_ids_to_tokens(ids[1:4]) == ["1", "2", "3"]
    assert tok.decode(ids, skip_special_tokens=True) == "123+45="


def test_save_then_from_pretrained_gives_the_same_logits(tmp_path):
    tok = tokenizer()
    model = build_policy(TINY, tok, seed=0).eval()
    out = save_pretrained_atomic(model, tok, tmp_path / "policy", extra={"stage": "test"})
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert json.loads((out / "rlhf_meta.json").read_text()) == {"stage": "test"}
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok2 = AutoTokenizer.from_pretrained(str(out))
    ids = tok2(["12+7=", "3+4="], return_tensors="pt", padding=True)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**ids).logits, model(**ids).logits, rtol=0, atol=0)


def test_atomic_save_replaces_a_previous_version_and_leaves_no_temp_dirs(tmp_path):
    tok = tokenizer()
    save_pretrained_atomic(build_policy(TINY, tok, seed=0), tok, tmp_path / "p")
    save_pretrained_atomic(build_policy(TINY, tok, seed=1), tok, tmp_path / "p")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]


def test_initializer_range_sets_the_std_of_the_initial_weights():
    tok = tokenizer()
    cfg = ModelConfig(hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4, num_kv_heads=4)
    for std in (0.02, 0.1):
        model = build_policy(cfg.model_copy(update={"initializer_range": std}), tok, seed=0)
        weight = model.model.layers[0].self_attn.q_proj.weight  # 16,384 draws of N(0, std^2)
        assert abs(weight.std().item() / std - 1) < 0.03
        assert model.config.initializer_range == std
