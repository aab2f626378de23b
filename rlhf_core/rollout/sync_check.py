"""Whether a rollout engine serves the trainer's weights, judged from what both compute: the
log-probs each gives a few fixed rollouts' tokens (`Probe`), teacher-forced. Pure arithmetic on
those figures, the same for every engine and transport; the policy stage runs it after every
weight sync (`rlhf_core.distributed.policy_sync`) and the GPU check on its stand-in engine.

A fingerprint of the engine's tensors cannot stand in for it: vLLM's CPU backend packs its
linear weights away into its kernels' formats, and a stale packed copy (a tied LM head after a
reload) is one of the faults to catch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

PROBE_ROWS = 4  # rollouts of the step scored by both sides after each sync


@dataclass(frozen=True)
class Probe:
    """The tokens both sides score: rank 0's first rollouts of the step that have a response."""

    rows: list  # policy_rollouts.Sample

    @property
    def prompt_ids(self) -> list[list[int]]:
        return [list(r.prompt_token_ids) for r in self.rows]

    @property
    def response_ids(self) -> list[list[int]]:
        return [list(r.response_token_ids) for r in self.rows]

    @property
    def tokens(self) -> int:
        return sum(len(r.response_token_ids) for r in self.rows)


def probe_of(samples: Sequence, room: int | None = None) -> Probe:
    """The first `PROBE_ROWS` samples with a response whose prompt and response leave a token of
    `room` (the engine's `max_model_len`; None: no limit): an engine scores them as a prompt and
    is asked for one token after it. Empty when none does (answers filling a model's context)."""
    rows = [s for s in samples if s.response_token_ids
            and (room is None or len(s.prompt_token_ids) + len(s.response_token_ids) < room)]
    return Probe(rows[:PROBE_ROWS])


def prob_gap(a: Sequence[Sequence[float]], b: Sequence[Sequence[float] | torch.Tensor]) -> float:
    """Mean over every token of |exp(a) - exp(b)|: the gap between two sets of log-probs of the
    same tokens (NaN anywhere: NaN)."""
    diffs = [abs(math.exp(x) - math.exp(float(y))) for row_a, row_b in zip(a, b, strict=True)
             for x, y in zip(row_a, row_b, strict=True)]
    return sum(diffs) / len(diffs) if diffs else 0.0


@dataclass(frozen=True)
class Verdict:
    gap: float  # the worst engine's mean |p_engine - p_trainer| over the probe's tokens
    moved: float | None = None  # first sync: the engine's move from the weights it sampled with
    trainer_moved: float | None = None  # and the trainer's
    noise: float = 0.0  # the gap before the update, both sides on the same weights: precision alone

    def failure(self, bound: float, tokens: int) -> str | None:
        if math.isnan(self.gap):
            return f"log-prob parity: the engine's token probabilities of {tokens} probe tokens are not numbers (NaN)"
        if self.gap > bound:
            return (f"log-prob parity: the engine's token probabilities differ from the trainer's by "
                    f"{self.gap:.4g} on average over {tokens} probe tokens, above {bound:g}")
        if (self.moved is not None and self.trainer_moved is not None and self.trainer_moved > 2 * self.noise
                and self.moved < self.trainer_moved / 2):  # a move within the precision's noise tells nothing
            return (f"moved from the SFT weights: the engine's token probabilities moved {self.moved:.3g} on "
                    f"average over {tokens} probe tokens, the trainer's {self.trainer_moved:.3g} (at least half "
                    f"of it expected)")
        return None


def verdict(engines: list[list[list[float]]], trainer: list[torch.Tensor],
            engine_before: list[list[list[float]]] | None, trainer_before: list[torch.Tensor] | None) -> Verdict:
    """The check of `engines`' log-probs (one list per engine) against the `trainer`'s, with,
    on the first sync, what both said before the update."""
    gap = max(prob_gap(e, trainer) for e in engines)
    if engine_before is None or trainer_before is None:
        return Verdict(gap)
    moved = min(prob_gap(now, then) for now, then in zip(engines, engine_before, strict=True))
    noise = max(prob_gap(then, trainer_before) for then in engine_before)
    return Verdict(gap, moved, prob_gap([t.tolist() for t in trainer], trainer_before), noise)
