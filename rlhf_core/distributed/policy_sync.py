"""The policy's weights into the rollout engine after every update (`sync`), and the engine's
proof that it serves them: a sync that did not take stops the run (fail closed).

The proof is what the engine computes (`rlhf_core.rollout.sync_check`): a few of the step's
own rollouts are scored teacher-forced by the engine (`Engine.probe`, each engine of a group)
and by the trainer's module, and the mean |p_engine - p_trainer| of their tokens must be within
the bound of the trainer's precision (`circuit_breaker.prob_diff_bound`: the bound
`rollout/prob_diff` is held to). After the first sync the engine must also have moved from the
weights it sampled with by at least half as much as the trainer moved from them, where that
move is beyond the precision's noise: a sync that leaves the SFT weights in the engine is
caught even when the first update is smaller than the bound.

A failed check syncs once more and checks again; a second failure stops the stage the circuit
breaker's way (no checkpoint of that step: the last one is the last good one), with one block
naming the transport, the check, the figure and its bound. Pipelined rollouts are not checked:
their engine takes weights between its own chunks, not at the sync.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf_core.distributed.deepspeed_engine import follow_gathers, gathered_module_state
from rlhf_core.distributed.fault_injection import skipped
from rlhf_core.distributed.policy_loop import PolicyWorker
from rlhf_core.distributed.policy_rollouts import syncs_from_the_module
from rlhf_core.models.lora import merged_entries, merged_state_dict
from rlhf_core.rollout.factory import streams
from rlhf_core.rollout.sync_check import PROBE_ROWS, Probe, probe_of, verdict
from rlhf_core.training.circuit_breaker import prob_diff_bound
from rlhf_core.training.policy_step import teacher_forced

def shared(check: "SyncCheck | None", src: int = 0) -> "SyncCheck":
    """Every rank: rank `src`'s check (every rank joins the trainer's forward under ZeRO-3)."""
    box = [check]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=src)
    return box[0]


def trainer_logprobs(w: PolicyWorker, probe: Probe) -> list[torch.Tensor]:
    """The trainer's teacher-forced log-probs of the probe's tokens (temperature 1), as it
    computes a step's old log-probs, in its precision. Every rank calls it (ZeRO-3 gathers)."""
    return teacher_forced(w.actor.module, probe.rows, w.tokenizer.pad_token_id, w.precision, w.actor.device, PROBE_ROWS)


@dataclass
class SyncCheck:
    """One step's check: the probe, and on the first step what both sides said before the update."""

    probe: Probe
    engine_before: list[list[list[float]]] | None = None  # rank 0
    trainer_before: list[torch.Tensor] | None = None

    def run(self, w, bound: float, resync: Callable[[], None]) -> tuple[dict[str, float], str | None]:
        """Every rank: check the engine (rank 0's) against the trainer; on a failure sync again
        (`resync`, every rank) and check once more. -> the step's metrics and, after a second
        failure, the block that stops the stage (None: the engine holds the trainer's weights)."""
        start = time.perf_counter()
        first: str | None = None
        for attempt in (1, 2):
            trainer = trainer_logprobs(w, self.probe)
            box: list = [None]
            if w.rank == 0 and getattr(w.engine, "asleep", False):  # its weights were released: nothing to ask
                box = [(None, "the engine still sleeps after the sync: no weights woke it")]
            elif w.rank == 0:
                engines = w.engine.probe(self.probe.prompt_ids, self.probe.response_ids)
                found = verdict(engines, trainer, self.engine_before, self.trainer_before)
                box = [(found, found.failure(bound, self.probe.tokens))]
            if w.world > 1:
                dist.broadcast_object_list(box, src=0)
            found, failed = box[0]
            if failed is None:
                metrics = {"rollout/verify_gap": found.gap, "rollout/verify_s": time.perf_counter() - start,
                           "rollout/verify_retries": float(attempt - 1)}
                return metrics, None
            if attempt == 1:
                first = failed
                resync()
        gap = found.gap if found is not None else math.nan
        return {"rollout/verify_gap": gap, "rollout/verify_s": time.perf_counter() - start}, \
            failure_block(w, first, failed)


def failure_block(w, first: str, second: str) -> str:
    cfg = w.cfg.rollout
    transport = f"policy.rollout.weight_sync={cfg.weight_sync} ({'stream' if streams(cfg, w.device.type) else 'file'}"
    transport += f", {cfg.placement} engine{'s' if cfg.placement == 'separate' else ''})"
    return (f"weight sync failed: the rollout engine does not serve the trainer's weights after the sync\n"
            f"  transport: {transport}\n"
            f"  check:     {first}\n"
            f"  retried:   {second}\n"
            f"  the engine would sample the next rollouts from other weights than the trainer's; see "
            f"docs/runbooks/RolloutWeightSyncDrift.md")


def policy_weights(w: PolicyWorker) -> dict[str, torch.Tensor] | None:
    """The actor's weights as the plain policy names them, on rank 0 (None elsewhere): what the
    rollout engine loads and the stage saves. Every rank must call it (ZeRO-3 gathers)."""
    if w.cfg.lora.enabled:  # ZeRO-1/2 only: every rank holds the whole module
        if w.rank != 0:
            return None
        if skipped("policy:lora-merge"):  # a test's merge that yields the base weights
            return {name: value.detach().float().cpu() for name, value, _ in merged_entries(w.actor.module)}
        return merged_state_dict(w.actor.module)
    return gathered_module_state(w.actor, w.cfg.zero_stage, w.rank)


def sync_engine(w: PolicyWorker) -> float:
    """Every rank: the engine takes the actor's weights; rank 0 returns the seconds (0 elsewhere).
    Streamed from the module itself where the run allows (`rollouts.syncs_from_the_module`: rank 0
    sends, the others join its ZeRO-3 gathers), else through a copy on rank 0."""
    if syncs_from_the_module(w):
        if w.rank == 0:
            return w.engine.sync_weights(w.actor.module)
        follow_gathers(w.actor.module)
        return 0.0
    state_dict = policy_weights(w)
    return w.engine.sync_weights(state_dict) if w.rank == 0 else 0.0


def sync(w: PolicyWorker, step: int) -> tuple[float, dict[str, torch.Tensor] | None]:
    """Every rank: the engine (or the pipeline's producer) takes the actor's weights. -> rank 0's
    seconds, and the weights as sent when a copy was made for it (else for the sync check, when due).
    A test breaks it through the fault switch: `skip:policy:sync` sends nothing, `skip:policy:sync-tensors`
    every other tensor only (through a copy), `skip:policy:lora-merge` LoRA's base weights (`policy_weights`)."""
    due = check_due(w, step)
    if skipped("policy:sync"):
        return 0.0, (policy_weights(w) if due else None)
    if syncs_from_the_module(w) and not skipped("policy:sync-tensors"):
        return sync_engine(w), (policy_weights(w) if due else None)
    state_dict = policy_weights(w)
    if w.rank != 0:
        return 0.0, state_dict
    if w.pipeline is not None:
        w.pipeline.publish(step, state_dict, copy=False)  # policy_weights made a private copy
        return w.pipeline.take_sync_seconds()[0], state_dict  # applied on the producer thread since the last step
    if skipped("policy:sync-tensors"):
        return w.engine.sync_weights(dict(list(state_dict.items())[::2])), state_dict
    return w.engine.sync_weights(state_dict), state_dict


def verifies(w: PolicyWorker) -> bool:
    """Whether every sync is checked (`policy.rollout.verify_sync`; not with pipelined rollouts)."""
    return w.cfg.rollout.verify_sync and verify_bound(w) is not None


def verify_bound(w: PolicyWorker) -> float | None:
    return prob_diff_bound(w.cfg.circuit_breaker, w.precision, w.cfg.pipeline.max_lag)


def verification(w: PolicyWorker, step: int, samples: list) -> SyncCheck | None:
    """Rank 0, right after generating: the step's probe, with the engine's own figures at step 1."""
    if not verifies(w):
        return None
    probe = probe_of(samples, w.engine.max_model_len)
    if not probe.rows:  # every answer fills the engine's context: nothing it can score, said
        print(f"policy: step {step}: no rollout leaves room to check the next sync with; it goes unchecked", flush=True)
        return None
    before = w.engine.probe(probe.prompt_ids, probe.response_ids) if step == 1 else None
    return SyncCheck(probe, engine_before=before)


def check_due(w: PolicyWorker, step: int) -> bool:
    """The test hook's comparison of greedy answers (`policy.rollout.check_sync`), after the first and the last step."""
    return w.cfg.rollout.check_sync and step in (1, w.cfg.steps)
