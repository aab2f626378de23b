"""The vLLM rollout engine against the trainer's Hugging Face model.

One engine for the whole module (start-up is ~40-60 s on two CPU cores). The policy is a
tiny Llama (hidden 64, 2 heads: head size 32, the smallest vLLM's CPU attention supports)
trained for a few seconds on the demo's sums, so that greedy answers depend on the prompt.
"""
from __future__ import annotations

import copy
import os
import random
import stat
from dataclasses import dataclass

import psutil
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from rlhf_core import vllm_scratch
from rlhf_core.config import ModelConfig, SFTConfig
from rlhf_core.data.synthetic import answer_for, prompt_for, sum_without_carry
from rlhf_core.eval.accuracy import greedy_completions
from rlhf_core.models.llama import build_policy, save_pretrained_atomic
from rlhf_core.rollout.hf_reference import recompute_logprobs
from rlhf_core.tokenizer import train_tokenizer
from rlhf_core.training.sft import train_sft

pytestmark = pytest.mark.slow

POLICY = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2)
MAX_NEW = 6  # three answer digits + </s>, with room to spare
LOGPROB_ATOL = 1e-4  # mean |vLLM - HF| per token, both in fp32; seen ~2e-7
MAX_SEQS = 128  # the engine's batch: its KV cache holds this many sequences of 64 tokens


@dataclass
class Policy:
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerFast
    prompts: list[str]
    pairs: list[tuple[int, int]]


def sums(n: int, seed: int) -> tuple[list[str], list[tuple[int, int]]]:
    rng = random.Random(seed)
    pairs = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(n)]
    return [prompt_for(a, b, 2) for a, b in pairs], pairs


def sft(model, tok, prompts, answers, epochs):
    cfg = SFTConfig(epochs=epochs, batch_size=16, learning_rate=3e-3, warmup_steps=10)
    train_sft(model, tok, prompts, answers, cfg)


def child_processes() -> dict[int, str]:
    """Live child processes of this process, except multiprocessing's resource tracker (one per
    parent, started by the first spawn and kept until the parent exits) and the processes of a
    Ray cluster that another test in this worker started (its helpers come and go on their own:
    a Ray Train run's placement-group cleaner exits some time after the run)."""
    out = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            name, cmdline = proc.name(), " ".join(proc.cmdline())
            zombie = proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            continue
        if name.startswith("ray::") or name in ("raylet", "gcs_server") or "/site-packages/ray/" in cmdline:
            continue
        if zombie or "resource_tracker" not in cmdline:
            out[proc.pid] = name
    return out


@pytest.fixture(scope="module")
def torch_one_thread():
    # Two cores shared with the engine's worker: two trainer threads only fight over them.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def policy(torch_one_thread) -> Policy:
    prompts, pairs = sums(1024, seed=0)
    tok = train_tokenizer([p + answer_for(a + b, 2) for p, (a, b) in zip(prompts, pairs)], vocab_size=64)
    model = build_policy(POLICY, tok, seed=0)
    sft(model, tok, prompts, [answer_for(a + b, 2) for a, b in pairs], epochs=3)
    return Policy(model.eval(), tok, prompts, pairs)


@pytest.fixture(scope="module")
def engine_env(policy, tmp_path_factory):
    from rlhf_core.rollout.vllm_engine import RolloutEngine

    model_dir = save_pretrained_atomic(policy.model, policy.tokenizer, tmp_path_factory.mktemp("rollout") / "policy")
    before = child_processes()
    # its worker in a process of its own (as under a trainer of more than one rank, or pipelined)
    engine = RolloutEngine(model_dir, dtype="float32", seed=0, max_model_len=64, max_num_seqs=MAX_SEQS, guest=False)
    print(f"\nengine start: {engine.start_seconds:.1f} s")
    try:
        yield engine, before
    finally:
        engine.close()


@pytest.fixture
def engine(engine_env):
    return engine_env[0]


def greedy_engine(engine, prompts) -> list[str]:
    return [r.response_text for r in engine.generate(prompts, n=1, temperature=0.0, max_tokens=MAX_NEW)]


def test_engine_greedy_equals_hf_greedy_after_loading(engine, policy):
    prompts = policy.prompts[:32]
    hf = greedy_completions(policy.model, policy.tokenizer, prompts, MAX_NEW)
    assert len(set(hf)) > 3, f"policy too weak to make this test meaningful: {hf}"
    assert greedy_engine(engine, prompts) == hf


def test_rollouts_carry_prompt_tokens_eos_and_one_logprob_per_token(engine, policy):
    tok = policy.tokenizer
    rollouts = engine.generate(policy.prompts[:4], n=1, temperature=0.0, max_tokens=MAX_NEW)
    for r, prompt in zip(rollouts, policy.prompts[:4]):
        assert r.prompt == prompt
        assert r.prompt_token_ids == tok(prompt)["input_ids"]  # <s> prepended once
        assert len(r.logprobs) == len(r.response_token_ids)
        assert all(lp <= 0 for lp in r.logprobs)
        if r.finish_reason == "stop":
            assert r.response_token_ids[-1] == tok.eos_token_id
        assert r.response_text == tok.decode(r.response_token_ids, skip_special_tokens=True)


def test_response_text_is_what_vllms_own_detokeniser_gives(engine, policy):
    """The engine skips vLLM's per-step detokenising and decodes each response once at the end."""
    from vllm import SamplingParams

    from rlhf_core.rollout.vllm_engine import prompt_seeds

    prompts = policy.prompts[:16]
    ours = engine.generate(prompts, n=4, temperature=1.0, max_tokens=MAX_NEW, seed=7)
    params = [SamplingParams(n=4, temperature=1.0, max_tokens=MAX_NEW, seed=s, logprobs=0) for s in prompt_seeds(7, 16)]
    theirs = [c for out in engine.llm.generate(prompts, params, use_tqdm=False) for c in sorted(out.outputs, key=lambda c: c.index)]
    assert [r.response_token_ids for r in ours] == [list(c.token_ids) for c in theirs]
    assert [r.response_text for r in ours] == [c.text for c in theirs]
    assert len({r.response_text for r in ours}) > 8  # sampled: the texts differ, so the comparison means something


def test_seeded_prompts_draw_random_numbers_of_their_own(engine, policy):
    """One seed for a call: the same prompt twice still gets different samples (each prompt
    its own seed), and the call repeats exactly."""
    prompt = policy.prompts[0]
    a = engine.generate([prompt, prompt], n=4, temperature=1.0, max_tokens=MAX_NEW, seed=5)
    first, second = ([r.response_token_ids for r in a if r.group == g] for g in (0, 1))
    assert first != second
    b = engine.generate([prompt, prompt], n=4, temperature=1.0, max_tokens=MAX_NEW, seed=5)
    assert [r.response_token_ids for r in a] == [r.response_token_ids for r in b]


def test_kv_cache_holds_max_num_seqs_sequences_of_max_model_len(engine):
    """Blocks of 128 tokens: one per 64-token sequence, and the block vLLM keeps back."""
    assert engine.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks == MAX_SEQS + 1


def test_sync_weights_updates_the_running_engine_in_place(engine, policy):
    prompts = policy.prompts[:32]
    pids = child_processes()
    before = greedy_engine(engine, prompts)
    trainer = copy.deepcopy(policy.model)
    # Teach the carry-less mistake: greedy answers must move for the test to mean anything.
    carryless = [answer_for(sum_without_carry(a, b), 2) for a, b in policy.pairs[:256]]
    sft(trainer, policy.tokenizer, policy.prompts[:256], carryless, epochs=1)
    trainer.eval()
    expected = greedy_completions(trainer, policy.tokenizer, prompts, MAX_NEW)
    assert expected != before
    try:
        seconds = engine.sync_weights(trainer.state_dict())
        print(f"\nsync_weights: {seconds * 1e3:.1f} ms ({sum(p.numel() for p in trainer.parameters())} parameters)")
        assert engine.last_metrics["rollout/sync_s"] == seconds > 0
        after = greedy_engine(engine, prompts)
        assert after == expected
        assert after != before
        assert child_processes() == pids  # same engine core and worker: not restarted
    finally:
        engine.sync_weights(policy.model.state_dict())  # leave the engine on the module's policy
    assert greedy_engine(engine, prompts) == before


def test_sampled_logprobs_match_the_trainer(engine, policy):
    """rollout/logprob_diff: vLLM's sampled-token logprobs vs the HF recompute, both fp32."""
    for temperature in (1.0, 0.7):
        rollouts = engine.generate(policy.prompts[:32], n=4, temperature=temperature, max_tokens=MAX_NEW, seed=0)
        hf = recompute_logprobs(
            policy.model, [r.prompt_token_ids for r in rollouts], [r.response_token_ids for r in rollouts], temperature
        )
        diff = torch.cat([(torch.tensor(r.logprobs) - h).abs() for r, h in zip(rollouts, hf)])
        print(f"\nrollout/logprob_diff T={temperature}: mean {diff.mean():.2e} max {diff.max():.2e} over {diff.numel()} tokens")
        assert diff.mean() < LOGPROB_ATOL
        assert diff.max() < 100 * LOGPROB_ATOL


def test_the_probe_gives_the_trainers_logprobs(engine, policy):
    """`probe`: teacher-forced log-probs of fixed tokens, the check of every weight sync."""
    rollouts = engine.generate(policy.prompts[:8], n=1, temperature=1.0, max_tokens=MAX_NEW, seed=0)
    prompts, responses = [r.prompt_token_ids for r in rollouts], [r.response_token_ids for r in rollouts]
    [probed] = engine.probe(prompts, responses)
    hf = recompute_logprobs(policy.model, prompts, responses, temperature=1.0)
    diff = torch.cat([(torch.tensor(e) - h).abs() for e, h in zip(probed, hf, strict=True)])
    assert [len(e) for e in probed] == [len(r) for r in responses]
    assert diff.mean() < LOGPROB_ATOL and diff.max() < 100 * LOGPROB_ATOL, diff
    # the same figures as the logprobs the engine reported when it sampled these tokens at T=1
    assert max(abs(a - b) for r, e in zip(rollouts, probed) for a, b in zip(r.logprobs, e)) < 100 * LOGPROB_ATOL


def test_n_samples_per_prompt_are_grouped_and_seeded_sampling_is_reproducible(engine, policy):
    prompts = policy.prompts[:8]
    a = engine.generate(prompts, n=4, temperature=1.0, max_tokens=MAX_NEW, seed=123)
    b = engine.generate(prompts, n=4, temperature=1.0, max_tokens=MAX_NEW, seed=123)
    c = engine.generate(prompts, n=4, temperature=1.0, max_tokens=MAX_NEW, seed=124)
    assert [(r.group, r.index) for r in a] == [(g, i) for g in range(8) for i in range(4)]
    assert all(r.prompt == prompts[r.group] for r in a)
    assert [(r.response_token_ids, r.logprobs) for r in a] == [(r.response_token_ids, r.logprobs) for r in b]
    assert [r.response_token_ids for r in a] != [r.response_token_ids for r in c]
    m = engine.last_metrics
    print(f"\ngenerate: {m['rollout/gen_tokens']:.0f} tokens in {m['rollout/gen_s']:.3f} s = {m['rollout/tokens_per_s']:.0f} tokens/s")


def test_seeded_prompts_hold_more_tokens_than_a_scheduler_step(engine, policy):
    """16 prompts of 43 tokens x 8 samples: 5,504 prompt tokens, more than vLLM's CPU step
    takes (4,096). With chunked prefill vLLM split one of them across two steps, and sampling
    a seeded request whose prefill was split crashed the CPU engine ("CPU Generator does not
    use offset")."""
    from rlhf_core.rollout.cpu_engine import CPU_PREFILL_TOKENS

    def worked_examples(j: int) -> str:  # four solved sums, then one to solve
        rows = range(5 * j, 5 * j + 5)
        return "".join(policy.prompts[i] + answer_for(sum(policy.pairs[i]), 2) for i in rows[:4]) + policy.prompts[rows[4]]

    prompts = [worked_examples(j) for j in range(16)]
    lengths = [len(policy.tokenizer(p)["input_ids"]) for p in prompts]
    assert max(lengths) + MAX_NEW <= 64 and 8 * sum(lengths) > CPU_PREFILL_TOKENS, lengths
    a = engine.generate(prompts, n=8, temperature=1.0, max_tokens=MAX_NEW, seed=7)
    b = engine.generate(prompts, n=8, temperature=1.0, max_tokens=MAX_NEW, seed=7)
    assert len(a) == 16 * 8 and all(r.response_token_ids for r in a)
    assert [r.response_token_ids for r in a] == [r.response_token_ids for r in b]


def test_engine_worker_computes_on_every_core_this_process_may_use(engine_env):
    """vLLM's "auto" binding would keep one core for its idle scheduler (half the machine here)."""
    engine, before = engine_env
    allowed = os.sched_getaffinity(0)
    workers = [p for p in map(psutil.Process, set(child_processes()) - set(before)) if "Worker" in p.name()]
    assert workers, "no vLLM worker process found"
    for worker in workers:  # vLLM pins each OpenMP thread to one core: look at all threads
        cores = set().union(*(os.sched_getaffinity(t.id) for t in worker.threads()))
        assert cores == allowed, f"{worker.name()} computes on cores {sorted(cores)} of {sorted(allowed)}"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ, "the binding leaked into this process"


@pytest.fixture(scope="module")
def guest_env(engine_env):
    """The module's policy in a second engine whose worker runs in this process (a guest, as in a
    trainer's rank of a world of one), started inside a torch.distributed world of one, as a
    Ray Train worker's. -> (engine, this process's children before it started)."""
    import torch.distributed as dist

    from rlhf_core.rollout.vllm_engine import RolloutEngine

    engine, _ = engine_env
    before = child_processes()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # not vLLM's ("highest"): the host's must stay
    guest = None
    try:
        guest = RolloutEngine(engine.model_dir, dtype="float32", seed=0, max_model_len=64, max_num_seqs=MAX_SEQS)
        yield guest, before
    finally:
        torch.set_float32_matmul_precision(precision)
        if guest is not None:
            guest.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_guest_worker_samples_what_a_worker_process_samples(engine, guest_env, policy):
    guest, _ = guest_env
    assert (engine.worker, guest.worker) == ("process", "guest")
    prompts = policy.prompts[:32]
    assert greedy_engine(guest, prompts) == greedy_engine(engine, prompts)
    a = engine.generate(prompts, n=4, temperature=1.0, max_tokens=MAX_NEW, seed=11)
    b = guest.generate(prompts, n=4, temperature=1.0, max_tokens=MAX_NEW, seed=11)
    assert [r.response_token_ids for r in a] == [r.response_token_ids for r in b]
    assert len({tuple(r.response_token_ids) for r in a}) > 8  # sampled: the comparison means something
    diff = torch.cat([(torch.tensor(x.logprobs) - torch.tensor(y.logprobs)).abs() for x, y in zip(a, b)])
    assert diff.max() < LOGPROB_ATOL, diff.max()


def test_a_guest_worker_keeps_to_its_own_rngs_threads_and_process(guest_env, policy):
    """The host's global RNGs do not move while the guest samples, and the guest's own move on
    (two unseeded calls differ, as in a process of its own); `torch.set_num_threads` is torch's
    again after vLLM's worker replaced it, and the float32 matmul precision the host's; the guest
    started no process."""
    import numpy as np

    from rlhf_core.rng import rng_state

    guest, before = guest_env
    host = rng_state()
    first, second = (guest.generate(policy.prompts[:16], n=4, temperature=1.0, max_tokens=MAX_NEW) for _ in range(2))
    assert [r.response_token_ids for r in first] != [r.response_token_ids for r in second]
    now = rng_state()
    assert now["python"] == host["python"] and torch.equal(now["torch"], host["torch"])
    assert all(np.array_equal(x, y) for x, y in zip(now["numpy"], host["numpy"]))
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert torch.get_num_threads() == threads + 1
    finally:
        torch.set_num_threads(threads)
    assert torch.get_float32_matmul_precision() == "high"
    assert child_processes() == before


def test_a_guest_closes_and_leaves_the_hosts_process_group(guest_env):
    """vLLM's engine core destroys torch's default process group as it shuts down: the host's
    (a trainer's) stays, and still computes."""
    import torch.distributed as dist

    guest, before = guest_env
    guest.close()
    assert dist.is_initialized() and dist.get_world_size() == 1
    ones = torch.ones(3)
    dist.all_reduce(ones)
    assert ones.tolist() == [1.0, 1.0, 1.0]
    assert child_processes() == before


def test_a_worker_joins_its_host_only_where_it_changes_nothing_for_it(monkeypatch):
    """Not on a world of more than one rank (every rank would have to build vLLM's groups), nor on
    a machine of two memory nodes (vLLM binds its process's memory to one), nor with the engine
    core in a process of its own."""
    import torch.distributed as dist
    from vllm.utils import cpu_resource_utils

    from rlhf_core.rollout.cpu_engine import worker_fits_here

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setattr(cpu_resource_utils, "get_visible_memory_node", lambda: [0])
    assert worker_fits_here()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert worker_fits_here()
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert not worker_fits_here()
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(cpu_resource_utils, "get_visible_memory_node", lambda: [0, 1])
    assert not worker_fits_here()
    monkeypatch.setattr(cpu_resource_utils, "get_visible_memory_node", lambda: [0])
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert not worker_fits_here()


def test_close_stops_every_engine_process(engine_env):
    """Runs last in this module: closes the shared engine (the fixture's close is a no-op then)."""
    engine, before = engine_env
    assert set(child_processes()) - set(before), "the engine should have started processes"
    scratch = engine._scratch  # vLLM's sockets, in this process's directory, not the temp directory
    assert scratch == vllm_scratch.root() / f"{vllm_scratch.PREFIX}{os.getpid()}"
    assert [p for p in scratch.iterdir() if stat.S_ISSOCK(p.lstat().st_mode)], list(scratch.iterdir())
    assert list(scratch.glob("vllm_dist_*")), list(scratch.iterdir())  # its worker's rendezvous file
    engine.close()
    engine.close()  # idempotent
    assert child_processes() == before
    assert not scratch.exists()  # this process's last engine is closed: nothing left in the temp directory
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(["07+48="])
