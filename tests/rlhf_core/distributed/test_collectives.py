"""Collectives on the device their backend serves: the rule, the trainers' collectives run
against a simulated NCCL group (which refuses a CPU tensor as NCCL does on a GPU), and no tensor
collective that goes around the rule."""
from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlhf_core.distributed import collectives
from rlhf_core.distributed.collectives import CollectiveDeviceError, check_device, served_devices

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("backend", "devices"), [("nccl", {"cuda"}), ("gloo", {"cpu"}),
                                                  ("cpu:gloo,cuda:nccl", {"cpu", "cuda"})])
def test_each_backend_serves_its_devices(backend, devices):
    assert served_devices(backend) == devices


def test_a_cpu_tensor_on_an_nccl_group_is_refused_before_it_reaches_nccl():
    with pytest.raises(CollectiveDeviceError, match="the reference measurement: a cpu tensor on a nccl process group"):
        check_device(torch.zeros(3), "nccl", "the reference measurement")
    check_device(torch.zeros(3), "cpu:gloo,cuda:nccl")
    check_device(torch.empty(3, device="meta"), "meta:gloo")  # the rule reads the device only


class SimulatedNccl:
    """`torch.distributed` as a GPU worker sees it: the default group is NCCL, which fails on a
    CPU tensor; a gloo group made beside it serves the CPU. One rank: a sum is the tensor."""

    def __init__(self):
        self.host = object()
        self.reduced = []

    def get_backend(self, group=None):
        return "gloo" if group is self.host else "nccl"

    def new_group(self, backend):
        assert backend == "gloo"
        return self.host

    def all_reduce(self, tensor, group=None, **_):
        if tensor.device.type not in served_devices(self.get_backend(group)):
            raise RuntimeError("NCCL error: Tensors must be CUDA and dense")
        self.reduced.append((tensor.device.type, self.get_backend(group)))


@pytest.fixture
def nccl(monkeypatch):
    fake = SimulatedNccl()
    for name in ("get_backend", "new_group", "all_reduce"):
        monkeypatch.setattr(collectives.dist, name, getattr(fake, name))
    monkeypatch.setattr(collectives.dist, "group", SimpleNamespace(WORLD=object()))
    monkeypatch.setattr(collectives, "_host_groups", {})
    return fake


def test_the_reference_measurement_reduces_its_host_figures_over_a_group_that_serves_the_cpu(nccl):
    """The first step's mean reward-model score and length, summed over the ranks: on an NCCL
    group a CPU float64 tensor raised at step 1 of every PPO/GRPO run with a reward model."""
    from rlhf_core.config import PolicyConfig
    from rlhf_core.distributed.policy_state import PolicyState
    from rlhf_core.distributed.policy_worker import _measure_reference

    cfg = PolicyConfig()
    w = SimpleNamespace(cfg=cfg, member_stats=[SimpleNamespace(mean=0.0, std=1.0)], world=1)
    state = PolicyState()
    _measure_reference(w, state, torch.tensor([[1.0, 3.0]]), torch.tensor([4, 6]), [("p", "a"), ("q", "b")])
    assert nccl.reduced == [("cpu", "gloo")]
    assert state.reference_score == pytest.approx(2.0) and state.reference_length == pytest.approx(5.0)


def test_no_module_calls_a_tensor_collective_around_the_rule():
    """`dist.all_reduce` and its kin only in `collectives`; the object collectives (pickled,
    placed by torch itself) and the weight broadcasts of `rollout/` (their own groups) aside."""
    tensor_collectives = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce", "reduce_scatter",
                          "reduce_scatter_tensor", "broadcast", "gather", "scatter", "all_to_all"}
    found = []
    for path in sorted((REPO / "rlhf_core").rglob("*.py")):
        if path.name == "collectives.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in tensor_collectives and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in ("dist", "torch.distributed")):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []


def test_the_frozen_reference_is_built_on_the_actors_device(tmp_path):
    """DPO/KTO with full fine-tuning kept the reference fp32 on the CPU, where its log-probs met
    the actor's CUDA ones in the loss. Both trainers build it with `frozen_reference` on the
    actor's device (a meta device stands in for the GPU here), and with LoRA build none."""
    from rlhf_core.config import LoRAConfig, ModelConfig
    from rlhf_core.models.llama import build_policy, save_pretrained_atomic
    from rlhf_core.models.lora import frozen_reference
    from rlhf_core.tokenizer import train_tokenizer

    tok = train_tokenizer(["01+02=003", "10+20=030"], vocab_size=32)
    tiny = ModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2)
    sft_dir = save_pretrained_atomic(build_policy(tiny, tok, seed=0), tok, tmp_path / "sft")
    reference = frozen_reference(sft_dir, LoRAConfig(), "meta")
    assert {p.device.type for p in reference.parameters()} == {"meta"} and not reference.training
    assert not any(p.requires_grad for p in reference.parameters())
    assert frozen_reference(sft_dir, LoRAConfig(enabled=True), "meta") is None
    for trainer in ("policy_worker.py", "offline_trainer.py"):  # neither builds its own, off the actor's device
        source = (REPO / "rlhf_core" / "distributed" / trainer).read_text()
        assert "frozen_reference(loop.sft_dir, cfg.lora, " in source and "reference = None if" not in source
