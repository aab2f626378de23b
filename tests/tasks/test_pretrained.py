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


def test_each_stage_on_gpus_carries_its_ranks_estimate_and_a_stage_on_a_cpu_machine_none(tmp_path, make_pretrained,
                                                                                          monkeypatch):
    """What each rank checks against its GPU's free memory when the stage starts, from the run's
    models: the reward stage's, the RL policy stage's (rank 0 with the engine), DPO's."""
    from tasks.pretrained import stage_gpu_need

    src, _ = make_pretrained(tmp_path, "llama")
    on_gpus = {"policy": {"use_gpu": True}, "reward": {"use_gpu": True}}
    cfg = parse_config({"output_dir": str(tmp_path / "runs"), **on_gpus})
    reward = stage_gpu_need("reward", cfg, src)
    policy = stage_gpu_need("policy", cfg, src, src)
    assert (reward.stage, policy.stage) == ("reward", "policy") and reward.rank0 == reward.others
    assert policy.rank0 > policy.others and "engine" in policy.parts  # the colocated engine is rank 0's
    dpo = parse_config({"output_dir": str(tmp_path / "runs"), **on_gpus, "policy": {"use_gpu": True,
                                                                                     "algorithm": "dpo"}})
    offline = stage_gpu_need("policy", dpo, src)
    assert offline.rank0 == offline.others and "engine" not in offline.parts
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    here = parse_config({"output_dir": str(tmp_path / "runs")})  # use_gpu: null on a machine without one
    assert stage_gpu_need("reward", here, src) is None and stage_gpu_need("policy", here, src, src) is None
