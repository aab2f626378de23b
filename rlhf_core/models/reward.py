"""The reward model: a Hugging Face `LlamaForSequenceClassification` with K outputs.

This is the standard HF/TRL reward-model format: the backbone of the SFT policy plus a
linear `score` head (hidden -> K, no bias) read at the last non-pad token of each sequence
(HF finds it through `config.pad_token_id`, so text must not contain the pad token, and
right padding changes nothing). Saved in HF format with `rlhf_meta.json` beside the weights,
holding the normalisation stats (`reward_mean`, `reward_std`) that turn raw scores into
standardised rewards for policy optimisation.

K = 1 is one plain reward model. K > 1 is an ensemble of K score heads sharing the backbone
(`reward.ensemble_size`): `score` is then the members' mean, the ensemble's central estimate,
and `reward_mean` / `reward_std` are that mean's stats; `score_members` gives every member's
raw score and `member_stats` in the meta file each member's own stats, for the conservative
aggregates of `rlhf_core.training.reward_shaping`.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedModel, PreTrainedTokenizerFast

from rlhf_core.data.pairs import TokenizedPairs, collate_pairs, encode_pair_text
from rlhf_core.models.llama import save_pretrained_atomic
from rlhf_core.tokenizer import load_tokenizer

META_FILE = "rlhf_meta.json"
AUDIT_DIR = "audit"  # the audit reward model (`reward.audit_share`), saved inside the ensemble's directory


def audit_model_dir(reward_dir: Path | str) -> Path | None:
    """The audit reward model saved with the reward model in `reward_dir`, or None."""
    path = Path(reward_dir) / AUDIT_DIR
    return path if (path / META_FILE).exists() else None


def current_audit_dir(policy_dir: Path | str | None, reward_dir: Path | str) -> Path | None:
    """The audit model that judges a policy: the one its preference rounds kept current (saved
    with the policy), else the reward stage's; None when neither stage kept one."""
    return (audit_model_dir(policy_dir) if policy_dir is not None else None) or audit_model_dir(reward_dir)


def reward_model_from_base(base_dir: Path | str, seed: int = 0, num_members: int = 1) -> PreTrainedModel:
    """The SFT policy's backbone with a fresh head of `num_members` outputs (init from `seed`).

    The policy's `lm_head` is dropped; `score` is new. The config must carry pad_token_id
    (pooling depends on it).
    """
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(str(base_dir), num_labels=num_members,
                                                               dtype=torch.float32)
    if model.config.pad_token_id is None:
        raise ValueError(f"{base_dir}: config has no pad_token_id; the reward model cannot find the last token")
    return model


def freeze_lower_layers(model: PreTrainedModel, layers: int) -> PreTrainedModel:
    """Freeze the backbone's embeddings and its lowest `layers` decoder layers (`reward.frozen_layers`;
    0: nothing). Autograd then stops the backward pass above them. -> `model`."""
    if layers == 0:  # any architecture, whatever it names its layers
        return model
    decoder = getattr(model.base_model, "layers", None)
    if decoder is None:
        raise ValueError(f"reward.frozen_layers: {type(model).__name__} has no decoder layers to freeze")
    if layers > len(decoder):
        raise ValueError(f"reward.frozen_layers is {layers} but the backbone has {len(decoder)} decoder layers")
    model.base_model.get_input_embeddings().requires_grad_(False)
    for layer in decoder[:layers]:
        layer.requires_grad_(False)
    return model


@torch.no_grad()
def score_members(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[str],
    responses: Sequence[str],
    max_length: int,
    batch_size: int = 64,
) -> torch.Tensor:
    """Every member's raw reward of each `<s> prompt response </s>` (cut to max_length tokens).
    -> (K, B) float32."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    was_training = model.training
    model.eval()
    pad = tokenizer.pad_token_id
    seqs = [encode_pair_text(tokenizer, p, r)[:max_length] for p, r in zip(prompts, responses)]
    out = []
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start : start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)  # (B, L) right padded
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, s in enumerate(chunk):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        device = next(model.parameters()).device
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits  # (B, K)
        out.append(logits.float().cpu())
    model.train(was_training)
    return torch.cat(out).T if out else torch.zeros(model.config.num_labels, 0)


def member_mean(members: torch.Tensor) -> torch.Tensor:
    """(K, B) -> (B,): the ensemble's central score; one member is returned as it is."""
    return members[0] if members.shape[0] == 1 else members.mean(0)


def score(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[str],
    responses: Sequence[str],
    max_length: int,
    batch_size: int = 64,
) -> torch.Tensor:
    """Scalar reward of each `<s> prompt response </s>` (cut to max_length tokens): the
    members' mean. -> (B,) float32."""
    return member_mean(score_members(model, tokenizer, prompts, responses, max_length, batch_size))


@torch.no_grad()
def score_pairs(model: PreTrainedModel, pairs: TokenizedPairs, batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards (the members' mean) of the chosen and of the rejected side of tokenized pairs.
    -> ((N,), (N,)) float32."""
    chosen, rejected = score_pairs_members(model, pairs, batch_size)
    return member_mean(chosen), member_mean(rejected)


@torch.no_grad()
def score_pairs_members(model: PreTrainedModel, pairs: TokenizedPairs, batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Every member's rewards of the chosen and of the rejected sides. -> ((K, N), (K, N)) float32."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    chosen, rejected = [], []
    for start in range(0, len(pairs), batch_size):
        batch = collate_pairs(pairs, range(start, min(start + batch_size, len(pairs))))
        rewards = model(
            input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device)
        ).logits.float().cpu()  # (2B, K)
        chosen.append(rewards[: batch.num_pairs])
        rejected.append(rewards[batch.num_pairs :])
    model.train(was_training)
    return torch.cat(chosen).T, torch.cat(rejected).T


@dataclass(frozen=True)
class RewardStats:
    """Mean and standard deviation of raw rewards over a reference set."""

    mean: float
    std: float


def reward_stats(scores: torch.Tensor) -> RewardStats:
    """Population mean and std of scores (B,). A constant set gets std 1 (normalising is then a shift)."""
    if scores.numel() == 0:
        raise ValueError("reward_stats of an empty set")
    scores = scores.double()
    std = scores.std(unbiased=False).item()
    return RewardStats(scores.mean().item(), std if std > 0 else 1.0)


def normalise(scores: torch.Tensor, stats: RewardStats) -> torch.Tensor:
    """(scores - mean) / std: rewards with mean 0 and std 1 on the reference set."""
    return (scores - stats.mean) / stats.std


def save_reward_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    out_dir: Path,
    stats: RewardStats,
    extra: dict | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """HF directory (safetensors) with `rlhf_meta.json` = {stage, reward_mean, reward_std, **extra};
    the weights in `dtype` (default: as the model holds them)."""
    meta = {"stage": "reward", **(extra or {}), "reward_mean": stats.mean, "reward_std": stats.std}
    return save_pretrained_atomic(model, tokenizer, out_dir, extra=meta, dtype=dtype)


def read_reward_meta(path: Path | str) -> dict:
    return json.loads((Path(path) / META_FILE).read_text())


def member_stats(meta: dict) -> tuple[RewardStats, ...]:
    """Each ensemble member's normalisation stats from a reward model's meta (one model: its own)."""
    pairs = meta.get("member_stats") or [[meta["reward_mean"], meta["reward_std"]]]
    return tuple(RewardStats(float(m), float(s)) for m, s in pairs)


def load_reward_model(path: Path | str) -> tuple[PreTrainedModel, PreTrainedTokenizerFast, RewardStats]:
    """A saved reward model (eval mode), its tokenizer and the normalisation stats of its
    (members' mean) score."""
    model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    meta = read_reward_meta(path)
    return model, load_tokenizer(path), RewardStats(meta["reward_mean"], meta["reward_std"])
