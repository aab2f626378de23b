"""Rank 0's side of policy optimisation: the vLLM engine's rollouts (synchronous, or from a
`RolloutPipeline` thread generating ahead), scattered to the ranks in whole prompt groups,
and the held-out evaluations through the same engine."""
from __future__ import annotations

import random
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlhf_core.distributed.policy_loop import PolicyWorker
from rlhf_core.eval.accuracy import answer_accuracy, greedy_completions
from rlhf_core.models.llama import load_policy
from rlhf_core.models.reward import normalise, score
from rlhf_core.rng import derive_seed
from rlhf_core.rollout.factory import engine_context, open_engine, streams
from rlhf_core.training.policy_step import prompt_indices
from rlhf_core.training.precision import computing_in

SYNC_CHECK_PROMPTS = 32
ROUND_CHUNK = 1000  # the seeds of a round's draws: chunks no step's generation uses
EVAL_SAMPLES = 4  # greedy answers kept with each evaluation: what the policy learned to say


@dataclass(frozen=True)
class Sample:
    """A rollout as plain data (the engine's `Rollout` would drag vLLM into every rank)."""

    group: int
    prompt: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_text: str
    logprobs: list[float]


def start_engine(w: PolicyWorker):
    """Rank 0: the run's engine through the rollout front door (`rollout.factory.open_engine`),
    started from the SFT policy, its context (and so, on CPU, its KV cache) sized for the longest
    prompt it will be given plus a response. Engines of their own (`policy.rollout.placement:
    separate`) get the placement groups this cluster reserves for them and stream to this node."""
    cfg, rollout, on_gpu = w.cfg, w.cfg.rollout, w.device.type == "cuda"
    context = engine_context([len(ids) for ids in w.tokenizer([*w.loop.prompts, *w.loop.eval_prompts])["input_ids"]],
                             cfg.max_new_tokens, w.actor.module.config.max_position_embeddings)
    bundles, address = None, "127.0.0.1"
    if rollout.placement == "separate":
        import ray  # noqa: PLC0415

        from rlhf_core.distributed.cluster import engine_bundles  # noqa: PLC0415

        bundles, address = engine_bundles(rollout.tensor_parallel_size, on_gpu), ray.util.get_node_ip_address()
    return open_engine(w.loop.sft_dir, rollout, precision=w.precision, device=w.device, seed=cfg.seed,
                       max_num_seqs=cfg.rollouts_per_step, max_model_len=context, pipelined=cfg.pipeline.max_lag > 0,
                       bundles=bundles, master_address=address, name=f"rollout-engine-{w.loop.runtime.run_token}")


def syncs_from_the_module(w: PolicyWorker) -> bool:
    """Every rank: whether the sync streams the trainer's module itself (`weight_transfer.ModuleSource`:
    rank 0 sends, the others join its ZeRO-3 gathers; `MergedLoraSource`: a LoRA policy merged one
    weight at a time), so that no copy of the model is made. Not when pipelined: the producer
    thread syncs a snapshot later, while the ranks train on."""
    return streams(w.cfg.rollout, w.device.type) and w.cfg.pipeline.max_lag == 0


def generate(w: PolicyWorker, indices: list[int], step: int) -> list[list[Sample]]:
    """Rank 0: the rollouts of RL step `step` (1-based), split into one list per rank in whole
    prompt groups."""
    return per_rank(_sample(w, indices, seed=derive_seed(w.cfg.seed, step)), w.world)


def _sample(w: PolicyWorker, indices: list[int], seed: int, group_offset: int = 0) -> list[Sample]:
    """Rank 0: `samples_per_prompt` responses to each of the prompts `indices`, from the engine;
    their groups numbered from `group_offset` (a chunk's place in its step's batch)."""
    cfg = w.cfg
    rollouts = w.engine.generate([w.loop.prompts[i] for i in indices], n=cfg.samples_per_prompt,
                                 temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_new_tokens, seed=seed)
    return [Sample(group_offset + r.group, r.prompt, r.prompt_token_ids, r.response_token_ids, r.response_text,
                   r.logprobs) for r in rollouts]


def per_rank(samples: list[Sample], world: int) -> list[list[Sample]]:
    per = len(samples) // world  # prompts_per_step % world == 0: groups never straddle ranks
    return [samples[r * per : (r + 1) * per] for r in range(world)]


def start_pipeline(w: PolicyWorker, first_step: int):
    """Rank 0, pipelined mode: a producer thread generating steps first_step.. ahead of training
    (`rlhf_core.rollout.pipeline`), in `cfg.pipeline.chunks` engine calls of whole prompt groups
    per step; the engine holds version first_step - 1 (the SFT policy, or the checkpoint's)."""
    from rlhf_core.rollout.pipeline import RolloutPipeline  # noqa: PLC0415  (rank 0 only)

    cfg = w.cfg

    def plan(step: int) -> list[tuple[int, int, int, list[int]]]:
        indices = prompt_indices(len(w.loop.prompts), cfg.prompts_per_step, step - 1, cfg.seed)
        parts = np.array_split(np.arange(len(indices)), cfg.pipeline.chunks)
        return [(step, k, int(part[0]), [indices[i] for i in part]) for k, part in enumerate(parts) if len(part)]

    def run_chunk(chunk: tuple[int, int, int, list[int]]) -> list[Sample]:
        step, k, offset, indices = chunk
        return _sample(w, indices, seed=derive_seed(cfg.seed, step, chunk=k), group_offset=offset)

    return RolloutPipeline(plan, run_chunk, w.engine.sync_weights, first_step=first_step, last_step=cfg.steps,
                           max_lag=cfg.pipeline.max_lag)


def take_pipelined(w: PolicyWorker, step: int) -> tuple[list[list[Sample]], dict[str, float]]:
    """Rank 0, pipelined mode: the step's batch from the producer, split per rank like
    `generate`, and how stale it is."""
    batch = w.pipeline.take(step)
    lags = batch.lags()
    metrics = {
        "pipeline/lag_mean": float(np.mean(lags)),
        "pipeline/lag_max": float(max(lags)),
        "pipeline/wait_s": batch.wait_s,
    }
    return per_rank(batch.rollouts, w.world), metrics


def round_items(w: PolicyWorker, step: int):
    """Rank 0: a pair of answers of the current policy (the engine's weights) to each of
    `rounds.prompts` prompts drawn afresh for this round, as `preference_rounds.Item`s: the
    first two distinct ones of `rounds.samples_per_prompt` samples (equal when all are)."""
    from rlhf_core.training.preference_rounds import Item  # noqa: PLC0415

    cfg = w.cfg
    n = min(cfg.rounds.prompts, len(w.loop.prompts))
    indices = random.Random(derive_seed(cfg.seed, step, chunk=ROUND_CHUNK)).sample(range(len(w.loop.prompts)), n)
    rollouts = w.engine.generate([w.loop.prompts[i] for i in indices], n=cfg.rounds.samples_per_prompt,
                                 temperature=cfg.temperature,
                                 top_p=cfg.top_p, max_tokens=cfg.max_new_tokens,
                                 seed=derive_seed(cfg.seed, step, chunk=ROUND_CHUNK + 1))
    answers: dict[int, list[str]] = {}
    prompts: dict[int, str] = {}
    for r in rollouts:
        answers.setdefault(r.group, []).append(r.response_text)
        prompts[r.group] = r.prompt
    distinct = {g: list(dict.fromkeys(a)) for g, a in answers.items()}
    return [Item(prompts[g], d[0], d[1] if len(d) > 1 else d[0]) for g, d in sorted(distinct.items())]


def engine_at_newest(w: PolicyWorker):
    """Rank 0: the engine to itself with the newest weights (pipelined), or as it is (sync)."""
    return w.pipeline.exclusive() if w.pipeline is not None else nullcontext()


def evaluate(w: PolicyWorker, step: int) -> dict[str, float]:
    """Rank 0: held-out exact match of greedy answers through the engine (when the eval set has
    answers), and their mean normalised reward-model score."""
    prompts, answers = list(w.loop.eval_prompts), list(w.loop.eval_answers)
    start = time.perf_counter()
    responses = [r.response_text for r in w.engine.generate(prompts, n=1, temperature=0.0, max_tokens=w.cfg.max_new_tokens)]
    out: dict[str, float] = {"step": step}
    if answers:
        out["eval/accuracy"] = answer_accuracy(prompts, responses, answers, w.loop.answer_checker)
    with computing_in(w.precision, w.actor.device):  # the precision the training steps score in
        if w.reward_model is not None:
            raw = score(w.reward_model, w.reward_tokenizer, prompts, responses, max_length=w.max_length)
            out["eval/rm_score"] = normalise(raw, w.rm_stats).mean().item()
        if w.audit is not None:
            audit_model, audit_tokenizer, audit_stats = w.audit
            raw = score(audit_model, audit_tokenizer, prompts, responses, max_length=w.max_length)
            out["eval/audit_score"] = normalise(raw, audit_stats).mean().item()
    out["eval/response_length"] = sum(len(r) for r in responses) / max(len(responses), 1)
    out["eval/samples"] = [[p, r] for p, r in zip(prompts[:EVAL_SAMPLES], responses[:EVAL_SAMPLES])]
    out["eval/seconds"] = time.perf_counter() - start
    return out


def evaluation_metrics(evaluation: dict[str, Any]) -> dict[str, float]:
    """An evaluation's figures as flat metrics: without its step and its sample answers."""
    return {k: v for k, v in evaluation.items() if k not in ("step", "eval/samples")}


def sync_check(w: PolicyWorker, state_dict: dict[str, torch.Tensor], step: int) -> dict[str, Any]:
    """Rank 0 (test hook): greedy answers of the engine vs the trainer's weights under HF generate."""
    prompts = list(w.loop.eval_prompts[:SYNC_CHECK_PROMPTS])
    max_new = w.cfg.max_new_tokens
    model = load_policy(w.loop.sft_dir)
    model.load_state_dict(state_dict)
    hf = greedy_completions(model, w.tokenizer, prompts, max_new)
    engine = [r.response_text for r in w.engine.generate(prompts, n=1, temperature=0.0, max_tokens=max_new)]
    sft = greedy_completions(load_policy(w.loop.sft_dir), w.tokenizer, prompts, max_new)
    return {"step": step, "engine": engine, "hf": hf, "sft": sft}
