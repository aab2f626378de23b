"""Supervised fine-tuning of the base policy: next-token loss on the completion tokens only.

Single process, plain PyTorch, on the model's device: at demo size the SFT stage takes
seconds, and a distributed engine would only add start-up time. Metrics come out as flat `sft/<name>` dicts through
the `on_metrics` callback; the caller decides where they go.
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerFast

from rlhf_core.chat import response_ids
from rlhf_core.config import SFTConfig
from rlhf_core.training.stage_types import MetricsCallback

IGNORE_INDEX = -100


@dataclass
class SFTBatch:
    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    labels: torch.Tensor  # (B, L), IGNORE_INDEX on prompt and padding

    def to(self, device: torch.device) -> SFTBatch:
        return SFTBatch(self.input_ids.to(device), self.attention_mask.to(device), self.labels.to(device))


def encode_sft_batch(tokenizer: PreTrainedTokenizerFast, prompts: Sequence[str], completions: Sequence[str]) -> SFTBatch:
    """Right-padded `<s> prompt completion </s>` with labels only on `completion </s>`."""
    rows = []
    for prompt, completion in zip(prompts, completions, strict=True):
        p = tokenizer(prompt)["input_ids"]
        c = response_ids(tokenizer, completion)
        rows.append((p + c, [IGNORE_INDEX] * len(p) + c))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
    return SFTBatch(input_ids, mask, labels)


def completion_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over labelled positions. logits (B, L, V), labels (B, L)."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
    )


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """Learning-rate multiplier: linear warm-up, then cosine decay to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class SFTResult:
    steps: int
    final_loss: float
    seconds: float
    tokens_per_s: float
    history: list[dict[str, float]] = field(default_factory=list)


def train_sft(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[str],
    completions: Sequence[str],
    cfg: SFTConfig,
    on_metrics: MetricsCallback | None = None,
    log_every: int = 10,
) -> SFTResult:
    if not prompts:
        raise ValueError("SFT corpus is empty")
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    order = list(range(len(prompts)))
    steps_per_epoch = math.ceil(len(order) / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, total, cfg.warmup_steps))
    model.train()
    start, tokens, step, loss_value = time.perf_counter(), 0, 0, float("nan")
    history: list[dict[str, float]] = []
    for _epoch in range(cfg.epochs):
        rng.shuffle(order)
        for i in range(0, len(order), cfg.batch_size):
            idx = order[i : i + cfg.batch_size]
            batch = encode_sft_batch(tokenizer, [prompts[j] for j in idx], [completions[j] for j in idx]).to(device)
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            loss = completion_loss(logits, batch.labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            opt.step()
            sched.step()
            step += 1
            tokens += int(batch.attention_mask.sum())
            loss_value = loss.item()
            if step % log_every == 0 or step == total:
                metrics = {
                    "sft/loss": loss_value,
                    "sft/grad_norm": float(grad_norm),
                    "sft/lr": sched.get_last_lr()[0],
                    "sft/tokens_per_s": tokens / (time.perf_counter() - start),
                }
                history.append({"step": step, **metrics})
                if on_metrics:
                    on_metrics(step, metrics)
    model.eval()
    seconds = time.perf_counter() - start
    return SFTResult(step, loss_value, seconds, tokens / seconds, history)
