"""What a training worker pays for DeepSpeed: `import_deepspeed` in a fresh process, then one
ZeRO-2 step, as a stage's worker does (one gloo rank, no Ray)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # torch, transformers and DeepSpeed in a fresh process: ~15 s

REPO = Path(__file__).resolve().parents[3]
COMPILER = "torch._functorch.aot_autograd"  # what torch.compile imports and the model stack does not

STEP = """
import importlib, json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch, torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from rlhf_core.distributed.deepspeed_engine import MUON_MODULE, deepspeed_config, import_deepspeed

seen = {}
deepspeed = import_deepspeed(use_gpu=False)
seen["mlflow_after_import"] = "mlflow" in sys.modules
dist.init_process_group("gloo", rank=0, world_size=1)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2))
engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=deepspeed_config(
    train_batch_size=1, micro_batch_size=1, grad_accum_steps=1, max_grad_norm=1.0, zero_stage=2,
    learning_rate=1e-3, weight_decay=0.0, use_gpu=False))
before = next(engine.module.parameters()).detach().clone()
ids = torch.randint(0, 64, (1, 8))
engine.backward(engine(input_ids=ids, labels=ids).loss)
engine.step()
seen["moved"] = not torch.equal(before, next(engine.module.parameters()).detach())
seen["muon"] = MUON_MODULE in sys.modules
seen["compiler_after_step"] = "%s" in sys.modules
from deepspeed.runtime import compiler
seen["compile_restored"] = compiler.compile() is torch.compile
import mlflow  # importable again once DeepSpeed is in
seen["mlflow_imports"] = mlflow.__name__ == "mlflow"
importlib.reload(importlib.import_module("deepspeed.runtime.zero.muon.original_muon"))  # as DeepSpeed loads it
seen["compiler_after_reload"] = "%s" in sys.modules
dist.destroy_process_group()
print(json.dumps(seen))
""" % (COMPILER, COMPILER)


def test_a_zero2_step_neither_imports_mlflow_nor_compiles_deepspeeds_muon_kernels(free_ports):
    """DeepSpeed comes in without MLflow (its autotuner's optional import), which imports later as
    usual; ZeRO's first gradient reduction finds DeepSpeed's Muon module imported with its
    kernels uncompiled, so torch's compiler stays out of the worker; the control reloads that
    module as DeepSpeed would load it, and the compiler comes in."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", STEP, str(free_ports(1)[0])], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen == {"mlflow_after_import": False, "moved": True, "muon": True, "compiler_after_step": False,
                    "compile_restored": True, "mlflow_imports": True, "compiler_after_reload": True}, seen
