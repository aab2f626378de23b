"""A user's pretrained model is checked, and made the run's own, before anything trains."""
from __future__ import annotations

import pytest
from prefect.logging import disable_run_logger

from rlhf_core.config import parse_config
from rlhf_core.models.pretrained import PretrainedError
from rlhf_core.tokenizer import load_tokenizer
from tasks.pretrained import prepare_pretrained


def config(tmp_path, **model):
    return parse_config({"output_dir": str(tmp_path / "runs"), "model": model, "sft": {"enabled": False}})


def test_a_directory_that_is_not_a_model_stops_the_run_naming_it(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("not a model")
    with pytest.raises(PretrainedError, match=r"model.pretrained: .*notes holds no config.json: not a Hugging Face"):
        prepare_pretrained.fn(config(tmp_path, pretrained=str(tmp_path / "notes")), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing was written


def test_the_run_links_the_weights_and_completes_tokenizer_and_config(tmp_path, make_pretrained):
    src, _ = make_pretrained(tmp_path, "llama", chat_template=False)
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    with disable_run_logger():
        base = prepare_pretrained.fn(config(tmp_path, pretrained=str(src), chat_template=str(tmp_path / "t.jinja")),
                                     tmp_path / "out")
    assert base.policy == base.reward == tmp_path / "out" / "models" / "base"
    assert (base.policy / "model.safetensors").resolve() == (src / "model.safetensors").resolve()
    tokenizer = load_tokenizer(base.policy)
    assert tokenizer.chat_template == template and tokenizer.pad_token is not None
    assert load_tokenizer(src).chat_template is None  # the user's directory is untouched
    assert base.info.model_type == "llama" and base.summary()["status"] == "ready"


def test_a_head_size_vllm_cannot_run_is_refused_before_training(tmp_path, make_pretrained):
    from transformers import AutoConfig

    src, _ = make_pretrained(tmp_path, "mistral")
    cfg = AutoConfig.from_pretrained(src)
    cfg.head_dim = 48
    cfg.save_pretrained(src)
    with pytest.raises(PretrainedError, match="head size 48 is not one that vLLM's attention here supports"):
        prepare_pretrained.fn(config(tmp_path, pretrained=str(src)), tmp_path / "out")


@pytest.mark.parametrize(("settings", "environ", "here"), [
    ({}, {}, True),  # the local cluster on CPUs (use_gpu: null resolves to CPUs here)
    ({"policy": {"use_gpu": True}, "reward": {"use_gpu": True}}, {}, False),  # both stages on GPUs
    ({"policy": {"use_gpu": True}}, {}, True),  # the reward stage still trains in this machine's memory
    ({}, {"RAY_ADDRESS": "ray://head:10001"}, False),  # another cluster's nodes
])
def test_this_machines_memory_is_checked_only_when_the_stages_train_in_it(tmp_path, settings, environ, here):
    from tasks.pretrained import trains_on_this_machine

    cfg = parse_config({"output_dir": str(tmp_path / "runs"), **settings})
    assert trains_on_this_machine(cfg, environ) is here
