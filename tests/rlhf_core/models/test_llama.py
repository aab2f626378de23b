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


def saved_tensors(out) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_a_model_trained_in_bf16_is_saved_in_bf16_and_loads_back_as_those_weights(tmp_path, make_pretrained):
    _, model = make_pretrained(tmp_path, "qwen2")  # tied embeddings and head
    tok = tokenizer()
    out = save_pretrained_atomic(model, tok, tmp_path / "bf16", dtype=torch.bfloat16)
    saved = saved_tensors(out)
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert "lm_head.weight" not in saved  # the tied head is written once, as the embeddings
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert next(model.parameters()).dtype == torch.float32  # the model itself is left as it was
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor.bfloat16().float(), rtol=0, atol=0)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_by_default_the_weights_are_saved_as_the_model_holds_them(tmp_path):
    tok = tokenizer()
    out = save_pretrained_atomic(build_policy(TINY, tok, seed=0), tok, tmp_path / "fp32")
    assert {t.dtype for t in saved_tensors(out).values()} == {torch.float32}


def test_weights_over_the_shard_size_are_split_with_an_index(tmp_path, monkeypatch):
    import rlhf_core.models.llama as llama

    monkeypatch.setattr(llama, "MAX_SHARD_SIZE", "20KB")  # the tiny model is ~90 KB in fp32
    tok = tokenizer()
    model = build_policy(TINY, tok, seed=0).eval()
    out = save_pretrained_atomic(model, tok, tmp_path / "sharded")
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = tok(["12+7="], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(loaded(**ids).logits, model(**ids).logits, rtol=0, atol=0)


def test_initializer_range_sets_the_std_of_the_initial_weights():
    tok = tokenizer()
    cfg = ModelConfig(hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4, num_kv_heads=4)
    for std in (0.02, 0.1):
        model = build_policy(cfg.model_copy(update={"initializer_range": std}), tok, seed=0)
        weight = model.model.layers[0].self_attn.q_proj.weight  # 16,384 draws of N(0, std^2)
        assert abs(weight.std().item() / std - 1) < 0.03
        assert model.config.initializer_range == std
