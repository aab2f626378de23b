"""The data of one RL step: which prompts it samples, and the right-padded tensors of its
rollouts (`PolicyBatch`) that the phases of `rlhf_core.training.policy_step` fill in order.

Shapes: B sequences, L = prompt + response tokens (right padded), T response tokens.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Protocol

import torch


def prompt_indices(num_prompts: int, per_step: int, step: int, seed: int) -> list[int]:
    """The prompts of RL step `step` (0-based): positions [step*P, (step+1)*P) of an endless
    stream of per-epoch shuffles of range(num_prompts), each fixed by (seed, epoch). The step
    number is therefore all a checkpoint needs to continue at the next prompt batch."""
    if num_prompts < 1:
        raise ValueError("no prompts")
    out = []
    for pos in range(step * per_step, (step + 1) * per_step):
        epoch, offset = divmod(pos, num_prompts)
        order = list(range(num_prompts))
        random.Random(f"policy-prompts:{seed}:{epoch}").shuffle(order)
        out.append(order[offset])
    return out


class RolloutLike(Protocol):
    group: int
    prompt_token_ids: Sequence[int]
    response_token_ids: Sequence[int]
    logprobs: Sequence[float]


@dataclass
class PolicyBatch:
    """The tensors of one worker's rollouts. Phases fill the optional fields in order."""

    input_ids: torch.Tensor  # (B, L) long, <s> prompt response, right padded
    attention_mask: torch.Tensor  # (B, L) long
    positions: torch.Tensor  # (B, T) long: column of logits[:, :-1] that predicts response token t
    response_ids: torch.Tensor  # (B, T) long
    response_mask: torch.Tensor  # (B, T) float 0/1
    engine_logprobs: torch.Tensor  # (B, T) the rollout engine's logprobs of the sampled tokens
    group_ids: torch.Tensor  # (B,) long, the prompt each response answers
    old_logprobs: torch.Tensor | None = None  # (B, T) trainer's logprobs before the update
    ref_logprobs: torch.Tensor | None = None  # (B, T) frozen reference policy
    values: torch.Tensor | None = None  # (B, T) critic before the update (PPO)
    scores: torch.Tensor | None = None  # (B,) sequence reward
    advantages: torch.Tensor | None = None  # (B, T)
    returns: torch.Tensor | None = None  # (B, T) value targets
    is_weights: torch.Tensor | None = None  # (B, T) importance weights for lagged samples (pipelined mode)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor) -> "PolicyBatch":
        """Rows `index` of every tensor (None stays None)."""
        return replace(self, **{f.name: _rows(getattr(self, f.name), index) for f in fields(self)})

    def to(self, device: torch.device | str) -> "PolicyBatch":
        """Every tensor on `device` (the actor's): built on the CPU from the rollouts, the batch
        meets the models where they are."""
        return replace(self, **{f.name: None if (t := getattr(self, f.name)) is None else t.to(device)
                                for f in fields(self)})


def _rows(t: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t[index]


def build_batch(rollouts: Sequence[RolloutLike], pad_id: int) -> PolicyBatch:
    """Right-padded tensors of prompt + response per rollout (prompt ids start with <s>)."""
    if not rollouts:
        raise ValueError("build_batch: no rollouts")
    B = len(rollouts)
    L = max(len(r.prompt_token_ids) + len(r.response_token_ids) for r in rollouts)
    T = max(1, max(len(r.response_token_ids) for r in rollouts))
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    positions = torch.zeros((B, T), dtype=torch.long)
    response_ids = torch.full((B, T), pad_id, dtype=torch.long)
    response_mask = torch.zeros((B, T))
    engine_logprobs = torch.zeros((B, T))
    for b, r in enumerate(rollouts):
        p, n = len(r.prompt_token_ids), len(r.response_token_ids)
        input_ids[b, : p + n] = torch.tensor([*r.prompt_token_ids, *r.response_token_ids])
        attention_mask[b, : p + n] = 1
        # response token t sits at column p + t and is predicted by shifted column p + t - 1;
        # padding positions point at the last real column (any valid index would do)
        positions[b] = (p - 1 + torch.arange(T)).clamp(max=p + n - 2)
        response_ids[b, :n] = torch.tensor(list(r.response_token_ids), dtype=torch.long)
        response_mask[b, :n] = 1.0
        engine_logprobs[b, :n] = torch.tensor(list(r.logprobs), dtype=torch.float32)
    group_ids = torch.tensor([r.group for r in rollouts], dtype=torch.long)
    return PolicyBatch(input_ids, attention_mask, positions, response_ids, response_mask, engine_logprobs, group_ids)
