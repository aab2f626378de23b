"""Rollout engines of their own (`policy.rollout.placement: separate`): the arithmetic of their
placement and of the checks before training, then two real vLLM CPU engines as Ray actors on
the session's cluster, taking the trainer's weights over one gloo group. A policy fit through
separate engines: test_policy_trainer.py (the pipelined GRPO run)."""
from __future__ import annotations

import pytest
import torch

from rlhf_core.config import PolicyConfig, RolloutEngineConfig
from rlhf_core.distributed.cluster import check_engine_room, engine_bundles, engines_resources
from rlhf_core.rollout.factory import engine_sleeps
from rlhf_core.models.memory import ENGINE_OVERHEAD
from rlhf_core.models.pretrained import PretrainedInfo, engine_gpu_problem, training_bytes
from rlhf_core.rollout.engine_group import RemoteEngines, executor_backend, shares


def test_shares_cut_a_batch_into_contiguous_ranges_that_differ_by_at_most_one():
    assert shares(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shares(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert shares(1, 3) == [(0, 1), (1, 1), (1, 1)]  # engines with nothing to do get empty ranges
    for count in range(0, 30):
        for parts in range(1, 6):
            cut = shares(count, parts)
            assert cut[0][0] == 0 and cut[-1][1] == count
            assert all(a[1] == b[0] for a, b in zip(cut, cut[1:]))
            sizes = [b - a for a, b in cut]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    with pytest.raises(ValueError):
        shares(3, 0)


def test_an_engine_takes_a_gpu_and_a_cpu_per_tensor_parallel_rank_or_its_cpus():
    assert engine_bundles(2, use_gpu=True) == [{"GPU": 1.0, "CPU": 1.0}, {"GPU": 1.0, "CPU": 1.0}]
    assert engine_bundles(2, use_gpu=False) == [{"CPU": 2.0}]
    assert engines_resources(4, 2, use_gpu=True) == {"GPU": 8.0, "CPU": 8.0}
    assert engines_resources(3, 1, use_gpu=False) == {"CPU": 3.0}


def test_an_engine_of_one_cpu_process_runs_its_model_in_the_actor_and_tensor_parallel_gpus_in_ray_actors():
    assert executor_backend(1, use_gpu=False) == "uni"  # no second process importing vLLM
    assert executor_backend(2, use_gpu=False) is None  # vLLM's own (its CPU workers in processes)
    assert executor_backend(1, use_gpu=True) is None  # one GPU: vLLM already runs it in its engine core
    assert executor_backend(4, use_gpu=True) == "ray"  # workers as actors in the engine's placement group


def test_the_cluster_must_hold_the_workers_and_the_engines_together():
    check_engine_room("policy", 8, True, 4, 2, {"CPU": 64.0, "GPU": 16.0})  # 8 + 4 x 2 GPUs: fits exactly
    with pytest.raises(ValueError, match=r"policy.num_workers=8 with policy.rollout.num_engines=4 of "
                                         r"tensor_parallel_size=2 .*GPU 16 needed, 15 in the cluster"):
        check_engine_room("policy", 8, True, 4, 2, {"CPU": 64.0, "GPU": 15.0})
    with pytest.raises(ValueError, match=r"CPU 5 needed, 4 in the cluster"):
        check_engine_room("policy", 3, False, 2, 1, {"CPU": 4.0})


def test_engines_of_their_own_are_asked_for_by_placement_and_never_sleep():
    with pytest.raises(ValueError, match="need engines of their own: set policy.rollout.placement: separate"):
        PolicyConfig(rollout={"num_engines": 2})
    with pytest.raises(ValueError, match="need engines of their own"):
        PolicyConfig(rollout={"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="sleep: true with placement: separate"):
        PolicyConfig(rollout={"placement": "separate", "sleep": True})
    separate = RolloutEngineConfig(placement="separate", num_engines=2)
    assert engine_sleeps(separate, pipelined=False, device_type="cuda") is False
    assert engine_sleeps(RolloutEngineConfig(), pipelined=False, device_type="cuda") is True


def info(parameters: int) -> PretrainedInfo:
    return PretrainedInfo(path="m", model_type="llama", num_parameters=parameters, num_layers=32, hidden_size=4096,
                          head_dim=128, num_heads=32, num_kv_heads=8, vocab_size=128256, context_length=8192,
                          tie_word_embeddings=False, has_chat_template=True, pad_is_eos=False, intermediate_size=14336)


def test_each_engine_counts_on_the_host_and_must_leave_its_kv_cache_room_on_its_gpus():
    one = training_bytes(10**8, workers=1, with_critic=False, reward_parameters=10**8, kv_cache=10**6)
    three = training_bytes(10**8, workers=1, with_critic=False, reward_parameters=10**8, kv_cache=10**6, engines=3)
    assert three - one == 2 * (10**8 * 4 + 10**6 + ENGINE_OVERHEAD)  # a copy of the weights, a KV cache, a process
    # 7B in bf16 is 14 GB: on one 80 GB GPU at 0.5 it fits (14 <= 0.8 x 40); at 0.2 it does not
    policy = PolicyConfig(precision="bf16", rollout={"placement": "separate", "gpu_memory_utilization": 0.2})
    refusal = engine_gpu_problem(info(7 * 10**9), policy, 80 * 2**30)
    assert refusal is not None and "raise policy.rollout.tensor_parallel_size or gpu_memory_utilization" in refusal
    split = policy.model_copy(update={"rollout": policy.rollout.model_copy(update={"tensor_parallel_size": 2})})
    assert engine_gpu_problem(info(7 * 10**9), split, 80 * 2**30) is None  # 7 GB a GPU <= 0.8 x 16 GB
    assert engine_gpu_problem(info(7 * 10**9), PolicyConfig(precision="bf16", rollout={"placement": "separate"}),
                              80 * 2**30) is None


class Recorder:
    """An engine actor's `collective_rpc.remote`, recording its calls."""

    def __init__(self, calls: list):
        self.calls = calls
        self.collective_rpc = self

    def remote(self, method, timeout, args):
        import ray

        self.calls.append((self, method, timeout, args))
        return ray.put([f"{method} done"])


def test_every_engine_joins_the_group_at_its_own_ranks(ray_cluster):
    calls: list = []
    actors = [Recorder(calls), Recorder(calls), Recorder(calls)]
    engines = RemoteEngines(actors, workers_per_engine=2)
    assert engines.engine_workers == 6
    info_ = {"master_address": "10.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 7}
    assert engines.collective_rpc("init_weight_transfer_engine", 5.0, (info_,)) == ["init_weight_transfer_engine done"] * 3
    assert [args[0]["rank_offset"] for _, _, _, args in calls] == [1, 3, 5]  # the trainer is rank 0
    assert all(args[0]["world_size"] == 7 and timeout == 5.0 for _, _, timeout, args in calls)
    assert info_["rank_offset"] == 1  # the caller's payload is not changed
    calls.clear()
    engines.collective_rpc("start_weight_update", 5.0, ())
    assert [(a, m, args) for a, m, _, args in calls] == [(a, "start_weight_update", ()) for a in actors]


@pytest.mark.slow
def test_two_engines_as_ray_actors_answer_as_one_and_follow_streamed_weights(ray_cluster, demo):
    """Two vLLM CPU engines, each a Ray actor in a placement group of its own: greedy answers are
    the trainer's; seeded samples are those one engine draws for the whole batch; weights streamed
    over one gloo group (the trainer rank 0, each engine's worker at its own rank) reach both; and
    closing leaves no actor or placement group behind."""
    import psutil
    import ray

    from rlhf_core.eval.accuracy import greedy_completions
    from rlhf_core.models.llama import load_policy
    from rlhf_core.rollout.engine_group import EngineGroup
    from rlhf_core.rollout.vllm_engine import prompt_seeds
    from rlhf_core.rollout.weight_transfer import GLOO_BACKEND, StreamingTransport
    from rlhf_core.tokenizer import load_tokenizer

    model, tokenizer = load_policy(demo["sft"]), load_tokenizer(demo["sft"])
    prompts, max_new = demo["eval_prompts"][:24], 6
    group = EngineGroup(str(demo["sft"]), num_engines=2, tensor_parallel_size=1, use_gpu=False, bundles=engine_bundles(1, False),
                        transport=StreamingTransport(GLOO_BACKEND, timeout_s=120.0, master_address="127.0.0.1"),
                        seed=0, max_num_seqs=96, max_model_len=64, dtype="float32", enforce_eager=True)
    actors, groups = list(group.actors), list(group.groups)
    try:
        assert len({ray.get(a.node_id.remote()) for a in actors}) == 1 and len(groups) == 2
        # each engine is one process: its model runs in the actor, no vLLM worker process beside it
        children = ray.get([a.__ray_call__.remote(lambda actor: [c.name() for c in psutil.Process().children()])
                            for a in actors])
        assert not [name for names in children for name in names if name.startswith("VLLM::")], children

        def greedy() -> list[str]:
            return [r.response_text for r in group.generate(prompts, n=1, temperature=0.0, max_tokens=max_new)]

        assert greedy() == greedy_completions(model, tokenizer, prompts, max_new)
        sampled = group.generate(prompts, n=4, seed=11, max_tokens=max_new)
        assert [(r.group, r.index) for r in sampled] == [(g, i) for g in range(len(prompts)) for i in range(4)]
        whole = ray.get(actors[1].generate.remote(prompts, {"n": 4, "max_tokens": max_new,
                                                              "seeds": prompt_seeds(11, len(prompts))}))
        assert [r.response_token_ids for r in whole] == [r.response_token_ids for r in sampled]
        # unseeded samples follow each engine's generator, seeded with the engine's seed (seed + i)
        # as vLLM's worker seeds its process, not the actor's random start
        assert ray.get([a.__ray_call__.remote(lambda actor: torch.initial_seed()) for a in actors]) == [0, 1]

        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.2 * p.std() * torch.randn_like(p))
        moved = greedy_completions(model, tokenizer, prompts, max_new)
        group.sync_weights(model.state_dict())
        assert greedy() == moved
        assert group.last_metrics["rollout/sync_s"] > 0
    finally:
        group.close()
    table = ray.util.placement_group_table()
    assert all(table[g.id.hex()]["state"] == "REMOVED" for g in groups)
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.node_id.remote(), timeout=30)
