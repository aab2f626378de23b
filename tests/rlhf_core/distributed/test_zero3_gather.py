"""The actor's weights gathered from ZeRO-3 shards, one parameter at a time.

Two CPU processes (gloo, no Ray) hold a tiny Llama with a tied head, partitioned by DeepSpeed
ZeRO-3. `gathered_module_state` must give rank 0 exactly the whole-model state dict, with
every gather holding one parameter: a rank's device then never holds the whole model at once,
which is what lets a model that only fits sharded be synced and saved. The streamed sync's
source (`weight_transfer.ModuleSource`, rank 0) and `follow_gathers` (the other ranks) must
make the same gathers in lockstep, one parameter each, and yield the whole model, as its
metadata says, with no state dict built. Each rank is this file run as a script.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # DeepSpeed in two fresh processes: ~20 s

REPO = Path(__file__).resolve().parents[3]


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_core.distributed.deepspeed_engine import import_deepspeed
    from rlhf_core.distributed.deepspeed_engine import deepspeed_config, follow_gathers, gathered_module_state
    from rlhf_core.rollout.weight_transfer import ModuleSource

    deepspeed = import_deepspeed(use_gpu=False)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}  # before partitioning
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=deepspeed_config(
        train_batch_size=world, micro_batch_size=1, grad_accum_steps=1, max_grad_norm=1.0, zero_stage=3,
        learning_rate=1e-3, weight_decay=0.0, use_gpu=False))
    partitioned = [p for p in engine.module.parameters() if hasattr(p, "ds_id")]

    sizes: list[int] = []  # how many parameters each gather held
    original = deepspeed.zero.GatheredParameters

    def counting(params, *args, **kwargs):
        sizes.append(len(list(params)))
        return original(params, *args, **kwargs)

    deepspeed.zero.GatheredParameters = counting
    try:
        state = gathered_module_state(engine, zero_stage=3, rank=rank)
        gather_sizes, sizes = sizes, []
        streamed, meta = None, None
        if rank == 0:  # what a streamed sync sends, in the order it sends it; bf16 on the wire
            source = ModuleSource(engine.module, torch.bfloat16)
            meta = [(m.name, m.dtype, tuple(m.shape)) for m in source.metadata()]
            streamed = [(name, tensor.dtype, tuple(tensor.shape), tensor.clone()) for name, tensor in source]
        else:
            follow_gathers(engine.module)
    finally:
        deepspeed.zero.GatheredParameters = original
    released = all(p.ds_status.name == "NOT_AVAILABLE" for p in partitioned)  # every gather was let go again
    torch.save({"state": state, "expected": expected, "sizes": gather_sizes, "stream_sizes": sizes,
                "streamed": streamed, "meta": meta, "partitioned": len(partitioned), "released": released},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_zero3_weights_are_gathered_one_parameter_at_a_time_and_equal_the_whole_model(tmp_path, free_ports):
    world, port = 2, free_ports(1)[0]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(world), str(port), str(tmp_path)], cwd=REPO, env=env,
                              stdout=open(tmp_path / f"rank{r}.log", "w"), stderr=subprocess.STDOUT) for r in range(world)]
    try:
        codes = [p.wait(240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0], [(tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(world)]
    zero, other = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world))

    assert other["state"] is None  # only rank 0 holds the copy
    assert zero["partitioned"] > 0 and zero["released"] and other["released"]
    assert sorted(zero["state"]) == sorted(zero["expected"]) and "lm_head.weight" in zero["state"]
    for name, tensor in zero["expected"].items():
        assert zero["state"][name].dtype == torch.float32 and zero["state"][name].device.type == "cpu"
        torch.testing.assert_close(zero["state"][name], tensor.float(), rtol=0, atol=0, msg=name)
    for rank in (zero, other):  # the same gathers on both ranks (a collective), each of one parameter
        assert rank["sizes"] and set(rank["sizes"]) == {1} and len(rank["sizes"]) >= rank["partitioned"], rank["sizes"]
    assert zero["sizes"] == other["sizes"]

    # the streamed sync: the same one-parameter gathers on both ranks, each tensor once (the tied
    # head rides with the embeddings), exactly as the metadata announced, in bf16
    assert zero["stream_sizes"] == other["stream_sizes"] == [1] * zero["partitioned"]
    assert [(n, d, s) for n, d, s, _ in zero["streamed"]] == zero["meta"]
    names = [n for n, *_ in zero["streamed"]]
    assert "lm_head.weight" not in names and sorted(names) == sorted(set(zero["expected"]) - {"lm_head.weight"})
    for name, dtype, _, tensor in zero["streamed"]:
        assert dtype == torch.bfloat16 and torch.equal(tensor, zero["expected"][name].to(torch.bfloat16)), name


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
