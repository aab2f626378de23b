"""LoRA adapters on the policy: target modules checked by name, only adapters train, the
reference is the same model with adapters off, and the merged model computes what the adapted
one does."""
from __future__ import annotations

import pytest
import torch

from rlhf_core.config import LoRAConfig, ModelConfig, PolicyConfig
from rlhf_core.models.llama import build_policy, load_policy, save_pretrained_atomic
from rlhf_core.models.lora import (
    check_target_modules, is_lora_model, load_policy_for_training, merged_entries, merged_policy, merged_state_dict,
    merged_weights, reference_view, with_lora,
)
from rlhf_core.tokenizer import load_tokenizer, train_tokenizer

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    tok = train_tokenizer([f"{a:02d}+{b:02d}={a + b:03d}" for a in range(30) for b in range(30)], vocab_size=64)
    return save_pretrained_atomic(build_policy(TINY, tok, seed=0), tok, tmp_path_factory.mktemp("lora") / "base")


def _ids():
    return torch.tensor([[1, 5, 9, 12, 7, 3], [1, 4, 4, 8, 2, 6]])


def test_a_target_module_the_model_lacks_is_refused_naming_its_modules(base_dir):
    model = load_policy(base_dir)
    with pytest.raises(ValueError, match=r"policy.lora.target_modules: 'query_key_value' is not a module of the "
                                         r"model \(LlamaForCausalLM\); its linear modules are down_proj, gate_proj, "
                                         r"k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"):
        check_target_modules(model, ["q_proj", "query_key_value"])
    check_target_modules(model, ["q_proj", "v_proj"])
    check_target_modules(model, "all-linear")
    with pytest.raises(ValueError, match="'attn', 'mlp.fc1' are not a module"):
        with_lora(model, LoRAConfig(enabled=True, target_modules=["attn", "mlp.fc1"]))


def test_only_the_adapters_train_and_the_reference_is_the_base_with_them_off(base_dir):
    base = load_policy(base_dir).eval()
    model = with_lora(load_policy(base_dir), LoRAConfig(enabled=True, rank=4, target_modules=["q_proj", "v_proj"]))
    assert is_lora_model(model) and not is_lora_model(base)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 2 * TINY.num_layers  # A and B on q_proj and v_proj of each layer
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # B starts at 0: move it so that the adapters change the output
                p.add_(0.1 * torch.randn_like(p))
        adapted = model(input_ids=_ids()).logits
        with reference_view(model, None) as ref:
            reference = ref(input_ids=_ids()).logits
        with reference_view(model, base) as ref:
            assert ref is base
    torch.testing.assert_close(reference, base(input_ids=_ids()).logits)
    assert not torch.allclose(adapted, reference)


@pytest.fixture(scope="module")
def tied_base_dir(base_dir, tmp_path_factory):
    """The base with its output head tied to the embeddings (SmolLM2, Qwen2 small models)."""
    model = load_policy(base_dir)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    return save_pretrained_atomic(model, load_tokenizer(base_dir), tmp_path_factory.mktemp("lora") / "tied")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_merged_policy_computes_what_the_adapted_one_does(base_dir, tied_base_dir, tied):
    path = tied_base_dir if tied else base_dir
    cfg = LoRAConfig(enabled=True, rank=4, alpha=8.0)
    model = with_lora(load_policy(path), cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
        adapted = model(input_ids=_ids()).logits
    # as DeepSpeed's full-parameter gather names them: a tied head once, under the embeddings' name
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert ("base_model.model.lm_head.weight" in state) is not tied
    merged = merged_policy(path, cfg, state).eval()
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert set(merged.state_dict()) == set(load_policy(path).state_dict())  # a plain model: no adapter keys
    assert (merged.lm_head.weight is merged.model.embed_tokens.weight) is tied
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=_ids()).logits, adapted, rtol=1e-5, atol=1e-5)


def _moved_adapters(model):
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    return model


def test_the_merged_state_dict_is_peft_s_merge_under_the_plain_names_and_leaves_the_model_alone(base_dir):
    """What the rollout engine receives after each update: equal to peft's own merge_and_unload
    (the reference), named as the plain model, and computed without changing the adapted model."""
    torch.manual_seed(0)
    cfg = LoRAConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
    model = _moved_adapters(with_lora(load_policy(base_dir), cfg)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merged_state_dict(model)
    for k, v in model.state_dict().items():  # no merge-and-unmerge: the base weights are bit for bit as they were
        assert torch.equal(v, before[k]), k
    reference = with_lora(load_policy(base_dir), cfg)
    reference.load_state_dict(before)
    expected = reference.merge_and_unload().state_dict()
    assert set(merged) == set(expected) == set(load_policy(base_dir).state_dict())
    for k in expected:
        torch.testing.assert_close(merged[k], expected[k].float(), rtol=0, atol=1e-6)
    assert not torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"],
                              load_policy(base_dir).state_dict()["model.layers.0.self_attn.q_proj.weight"])
    plain = load_policy(base_dir).eval()
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=_ids()).logits, model(input_ids=_ids()).logits, rtol=1e-5, atol=1e-5)


def test_merged_weights_come_one_at_a_time_as_the_state_dict_has_them_each_tied_tensor_once(base_dir):
    """What a streamed sync sends: the merged state dict's tensors, in its order, computed one at
    a time; with `tied_once` a tied head is left to its embeddings, which the engine loads it from."""
    torch.manual_seed(0)
    cfg = LoRAConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
    model = _moved_adapters(with_lora(load_policy(base_dir), cfg)).eval()
    merged = merged_state_dict(model)
    streamed = dict(merged_weights(model))
    assert list(streamed) == list(merged)
    for name, tensor in streamed.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, merged[name]), name
    once = [name for name, _ in merged_weights(model, tied_once=True)]
    assert [name for name, *_ in merged_entries(model, tied_once=True)] == once
    tied = model.get_base_model().config.tie_word_embeddings
    assert once == ([n for n in merged if n != "lm_head.weight"] if tied else list(merged))


def test_gradient_checkpointing_gives_the_same_gradients(base_dir):
    """Recomputing the activations in the backward pass changes memory, not the gradients."""
    cfg = LoRAConfig(enabled=True, rank=4)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = _moved_adapters(load_policy_for_training(base_dir, cfg, gradient_checkpointing=checkpointing)).train()
        assert model.get_base_model().is_gradient_checkpointing is checkpointing
        model(input_ids=_ids(), labels=_ids()).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert set(grads[0]) == set(grads[1]) and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_lora_settings_that_do_not_apply_are_refused():
    with pytest.raises(ValueError, match="policy.lora with zero_stage 3 is not supported"):
        PolicyConfig(algorithm="dpo", zero_stage=3, lora={"enabled": True})
    with pytest.raises(ValueError, match="policy.lora with zero_stage 3 is not supported"):
        PolicyConfig(algorithm="grpo", zero_stage=3, lora={"enabled": True})
    assert PolicyConfig(algorithm="grpo", lora={"enabled": True}).lora.enabled
    assert PolicyConfig(algorithm="dpo", lora={"enabled": True, "target_modules": ["q_proj"]}).lora.rank == 8


def test_trained_weights_that_miss_more_than_a_tied_head_are_refused_naming_them(tied_base_dir):
    cfg = LoRAConfig(enabled=True, rank=4)
    state = {n: p.detach().clone() for n, p in with_lora(load_policy(tied_base_dir), cfg).named_parameters()}
    del state["base_model.model.model.norm.weight"]
    with pytest.raises(RuntimeError, match=r"missing \['base_model.model.model.norm.weight'\], unexpected \[\]"):
        merged_policy(tied_base_dir, cfg, state)
