"""Preference pairs as reward-model batches, the held-out split, and the data-parallel plan.

A pair is scored as two sequences, `<s> prompt chosen </s>` and `<s> prompt rejected </s>`
(the same text `rlhf_core.models.reward.score` builds), right padded. Longer than
`max_length` tokens: "truncate" keeps the first `max_length` tokens and counts the pair,
"reject" raises `OverlengthError` naming the offending rows.

Data-parallel plan (`rank_step_indices`): every epoch shuffles all N pairs with a permutation
that depends only on (seed, epoch), keeps the first `steps × G` of them (G = global batch
= micro batch × grad-accumulation steps × world size; the other `N mod G` pairs, a different
set each epoch, are dropped) and deals them out with `shard`, so every rank runs the same
number of optimizer steps and optimizer step s of the epoch consumes exactly the
permutation's positions [s·G, (s+1)·G). The position (epoch, step) is therefore all a
checkpoint needs to resume on exactly the next batch.
"""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from rlhf_core.chat import response_ids

SHOWN_ROWS = 5  # offending rows named in an OverlengthError


class OverlengthError(ValueError):
    """Pairs longer than max_length with on_overlength="reject"."""


def encode_pair_text(tokenizer: PreTrainedTokenizerFast, prompt: str, response: str) -> list[int]:
    """Token ids of `<s> prompt response </s>`: the text a reward model scores (a response that
    ends with the EOS token, as a chat-rendered one does, gets no second one)."""
    ids = tokenizer(prompt + response)["input_ids"]
    return ids if ids and ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id]


@dataclass(frozen=True)
class TokenizedPairs:
    """Right-padded token ids of N pairs. ids: (N, W) int32 (both sides the same W <= max_length),
    lengths: (N,) int32."""

    chosen_ids: np.ndarray
    chosen_lengths: np.ndarray
    rejected_ids: np.ndarray
    rejected_lengths: np.ndarray
    pad_token_id: int
    truncated: int  # pairs with at least one side cut to max_length
    prompt_lengths: np.ndarray | None = None  # (N,) int32: tokens of the prompt (`tokenize_policy_pairs`)

    def __len__(self) -> int:
        return len(self.chosen_lengths)


@dataclass(frozen=True)
class PairBatch:
    """B pairs as one forward batch: rows [0, B) are the chosen, rows [B, 2B) the rejected."""

    input_ids: torch.Tensor  # (2B, L) long, right padded
    attention_mask: torch.Tensor  # (2B, L) long

    @property
    def num_pairs(self) -> int:
        return self.input_ids.shape[0] // 2


def row_label(row: Mapping[str, Any], index: int) -> str:
    """How an error names a row: its `id`, else its file line, else its position."""
    rid = row.get("id")
    if rid is not None and rid == rid:  # NaN != NaN: a missing id in a pandas row
        return f"id={rid}"
    if row.get("_line") is not None:
        return f"line {row['_line']}"
    return f"row {index}"


def _shown(rows: Sequence[Mapping[str, Any]], offending: list[tuple[int, int]]) -> str:
    """The first SHOWN_ROWS offending rows by name with their token counts, and how many more."""
    shown = ", ".join(f"{row_label(rows[i], i)} ({n} tokens)" for i, n in offending[:SHOWN_ROWS])
    return shown + (f" and {len(offending) - SHOWN_ROWS} more" if len(offending) > SHOWN_ROWS else "")


def _pad(seqs: list[list[int]], width: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([len(s) for s in seqs], dtype=np.int32)
    ids = np.full((len(seqs), width), pad, dtype=np.int32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    return ids, lengths


def tokenize_pairs(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerFast,
    max_length: int,
    on_overlength: Literal["truncate", "reject"] = "truncate",
) -> TokenizedPairs:
    """Tokenize `prompt`/`chosen`/`rejected` rows; see the module docstring for overlength."""
    if on_overlength not in ("truncate", "reject"):
        raise ValueError(f"on_overlength must be 'truncate' or 'reject', got {on_overlength!r}")
    chosen, rejected, over = [], [], []
    for i, row in enumerate(rows):
        c = encode_pair_text(tokenizer, row["prompt"], row["chosen"])
        r = encode_pair_text(tokenizer, row["prompt"], row["rejected"])
        if max(len(c), len(r)) > max_length:
            over.append((i, max(len(c), len(r))))
        chosen.append(c[:max_length])
        rejected.append(r[:max_length])
    if over and on_overlength == "reject":
        raise OverlengthError(
            f"{len(over)} of {len(rows)} preference pairs exceed max_length={max_length} tokens "
            f"(<s> prompt response </s>): {_shown(rows, over)}. Raise reward.max_length or set "
            f"reward.on_overlength=truncate"
        )
    pad = tokenizer.pad_token_id
    width = max((len(s) for s in chosen + rejected), default=1)
    c_ids, c_len = _pad(chosen, width, pad)
    r_ids, r_len = _pad(rejected, width, pad)
    return TokenizedPairs(c_ids, c_len, r_ids, r_len, pad, len(over))


def tokenize_policy_pairs(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerFast,
    max_length: int,
    on_overlength: Literal["truncate", "reject"] = "truncate",
) -> TokenizedPairs:
    """Pairs as a policy sees them: the prompt's ids, then each response's ids ending with EOS
    (`rlhf_core.chat.response_ids`), tokenized apart as a rollout is (prompt, then generated
    tokens), with `prompt_lengths` set so a loss can take the response tokens only.

    Longer than `max_length`: "truncate" cuts the response's tail and counts the pair,
    "reject" raises `OverlengthError` naming the rows. A prompt that leaves no room for one
    response token is always an error."""
    if on_overlength not in ("truncate", "reject"):
        raise ValueError(f"on_overlength must be 'truncate' or 'reject', got {on_overlength!r}")
    chosen, rejected, prompt_lengths, over, no_room = [], [], [], [], []
    for i, row in enumerate(rows):
        prompt = tokenizer(row["prompt"])["input_ids"]
        c = prompt + response_ids(tokenizer, row["chosen"])
        r = prompt + response_ids(tokenizer, row["rejected"])
        if len(prompt) >= max_length:
            no_room.append((i, len(prompt)))
        elif max(len(c), len(r)) > max_length:
            over.append((i, max(len(c), len(r))))
        chosen.append(c[:max_length])
        rejected.append(r[:max_length])
        prompt_lengths.append(len(prompt))
    if no_room:
        raise OverlengthError(
            f"{len(no_room)} of {len(rows)} preference pairs have a prompt of max_length={max_length} tokens or "
            f"more, which leaves no room for a response: {_shown(rows, no_room)}. Raise the max_length or shorten "
            "the prompts")
    if over and on_overlength == "reject":
        raise OverlengthError(
            f"{len(over)} of {len(rows)} preference pairs exceed max_length={max_length} tokens "
            f"(prompt, response, </s>): {_shown(rows, over)}. Raise the max_length or set on_overlength=truncate")
    width = max((len(s) for s in chosen + rejected), default=1)
    c_ids, c_len = _pad(chosen, width, tokenizer.pad_token_id)
    r_ids, r_len = _pad(rejected, width, tokenizer.pad_token_id)
    return TokenizedPairs(c_ids, c_len, r_ids, r_len, tokenizer.pad_token_id, len(over),
                          np.array(prompt_lengths, dtype=np.int32))


def response_mask(pairs: TokenizedPairs, indices: Sequence[int], width: int) -> torch.Tensor:
    """(2B, width - 1) 1 where the next-token log-prob at position t scores a response token
    (token t + 1 is past the prompt and inside the sequence), rows ordered as `collate_pairs`."""
    if pairs.prompt_lengths is None:
        raise ValueError("response_mask needs pairs from tokenize_policy_pairs (prompt lengths)")
    idx = np.asarray(indices, dtype=np.int64)
    starts = np.concatenate([pairs.prompt_lengths[idx]] * 2)  # (2B,)
    lengths = np.concatenate([pairs.chosen_lengths[idx], pairs.rejected_lengths[idx]])
    target = np.arange(1, width)[None, :]  # the token each position predicts
    return torch.from_numpy(((target >= starts[:, None]) & (target < lengths[:, None])).astype(np.int64))


def unpaired_examples(rows: Sequence[Mapping[str, Any]], desirable_share: float, seed: int) -> list[dict[str, Any]]:
    """Preference pairs as unpaired labelled answers (KTO's data): each pair gives either its
    chosen answer, labelled desirable, or its rejected one, labelled undesirable, never both;
    `desirable_share` of the pairs, drawn with `seed`, give the chosen one.
    -> [{"prompt", "completion", "desirable", "id"}] in the rows' order."""
    rng = random.Random(f"unpair:{seed}")
    order = list(range(len(rows)))
    rng.shuffle(order)
    chosen = set(order[: round(desirable_share * len(rows))])
    return [{"prompt": r["prompt"], "completion": r["chosen"] if i in chosen else r["rejected"],
             "desirable": i in chosen, "id": r.get("id", f"row {i}")} for i, r in enumerate(rows)]


def kto_examples(pairs: Sequence[Mapping[str, Any]], answers: Sequence[Mapping[str, Any]],
                 held_out_prompts: set[str], desirable_share: float, seed: int) -> list[dict[str, Any]]:
    """KTO's training examples: the pairs unpaired (`unpaired_examples`), then the labelled
    `answers` (prompt, completion, desirable; thumbs from the feedback) whose prompt is not among
    `held_out_prompts`, so a prompt held out from the pairs stays out of training.
    -> [{"prompt", "completion", "desirable", "id"}]"""
    examples = unpaired_examples(pairs, desirable_share, seed)
    examples += [{"prompt": a["prompt"], "completion": a["completion"], "desirable": bool(a["desirable"]),
                  "id": a.get("id", f"answer {i}")}
                 for i, a in enumerate(answers) if a["prompt"] not in held_out_prompts]
    return examples


def with_mismatched(examples: Sequence[Mapping[str, Any]], seed: int) -> list[dict[str, Any]]:
    """Each labelled answer as a row `tokenize_policy_pairs` takes: `chosen` is the example's
    own answer, `rejected` the answer of another example (the next one in a permutation drawn
    with `seed`) to the same prompt: the mismatched prompt-answer pair on which KTO estimates
    the policy's KL to the reference (Ethayarajh et al. 2024, §4.1)."""
    order = list(range(len(examples)))
    random.Random(f"mismatch:{seed}").shuffle(order)
    other = {order[k]: order[(k + 1) % len(order)] for k in range(len(order))}
    return [{"prompt": e["prompt"], "chosen": e["completion"], "rejected": examples[other[i]]["completion"],
             "id": e.get("id")} for i, e in enumerate(examples)]


def collate_pairs(pairs: TokenizedPairs, indices: Sequence[int]) -> PairBatch:
    """The pairs at `indices` as one right-padded batch, as wide as its longest sequence."""
    idx = np.asarray(indices, dtype=np.int64)
    lengths = np.concatenate([pairs.chosen_lengths[idx], pairs.rejected_lengths[idx]])  # (2B,)
    width = int(lengths.max())
    ids = np.concatenate([pairs.chosen_ids[idx, :width], pairs.rejected_ids[idx, :width]])  # (2B, width)
    mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
    return PairBatch(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask))


def split_by_prompt(
    rows: Sequence[Mapping[str, Any]], eval_share: float, seed: int
) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """(train, held-out) rows with no prompt in both, `eval_share` of the distinct prompts held out.

    Deterministic in (the set of prompts, eval_share, seed), independent of row order; each
    split keeps the rows' original order. With at least two distinct prompts both splits
    are non-empty.
    """
    if not 0 < eval_share < 1:
        raise ValueError(f"eval_share must be in (0, 1), got {eval_share}")
    prompts = sorted({row["prompt"] for row in rows})
    random.Random(seed).shuffle(prompts)
    n_eval = round(eval_share * len(prompts))
    if len(prompts) >= 2:
        n_eval = min(max(n_eval, 1), len(prompts) - 1)
    held_out = set(prompts[:n_eval])
    train = [row for row in rows if row["prompt"] not in held_out]
    evals = [row for row in rows if row["prompt"] in held_out]
    return train, evals


def shard(n_items: int, rank: int, world_size: int) -> list[int]:
    """Positions rank reads: rank, rank + W, rank + 2W, ... below n_items - n_items % W.

    Shards are disjoint and all exactly n_items // W long: the last n_items % W positions
    are dropped so every rank runs the same number of steps (DDP needs it).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    return list(range(rank, n_items - n_items % world_size, world_size))


def epoch_permutation(n_items: int, seed: int, epoch: int) -> list[int]:
    """The order of epoch `epoch`: a permutation of range(n_items) fixed by (seed, epoch) alone."""
    order = list(range(n_items))
    random.Random(f"reward-data:{seed}:{epoch}").shuffle(order)
    return order


def steps_per_epoch(n_items: int, global_batch: int) -> int:
    """Optimizer steps per epoch; the `n_items % global_batch` leftover pairs are dropped."""
    return n_items // global_batch


def rank_step_indices(
    n_items: int, seed: int, epoch: int, rank: int, world_size: int, per_rank_batch: int
) -> list[list[int]]:
    """For each optimizer step of `epoch`, the pair indices `rank` consumes (per_rank_batch each)."""
    steps = steps_per_epoch(n_items, per_rank_batch * world_size)
    order = epoch_permutation(n_items, seed, epoch)[: steps * per_rank_batch * world_size]
    mine = [order[p] for p in shard(len(order), rank, world_size)]
    return [mine[s * per_rank_batch : (s + 1) * per_rank_batch] for s in range(steps)]


@dataclass
class DataPosition:
    """Where a training run on pairs stands: the next (epoch, step in epoch) and what its
    committed steps consumed and measured. A checkpoint saves it whole (`asdict`)."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    consumed: list[list[int]] = field(default_factory=list)
    history: list[dict[str, float]] = field(default_factory=list)

    def advance(self, steps_in_epoch: int, consumed: list[int], metrics: dict[str, float]) -> None:
        self.global_step += 1
        self.step_in_epoch += 1
        if self.step_in_epoch == steps_in_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        self.consumed.append(consumed)
        self.history.append({"step": self.global_step, **metrics})
