"""The gates' greedy answers from an engine of the kind serving runs
(`rlhf_core.rollout.factory.open_serving_engine`: vLLM, in `serving.dtype`), so that the gates
judge what users of the served model will get. Hugging Face `generate` in the same precision can
answer otherwise where two tokens nearly tie, as bf16 kernels do on a GPU.

One engine at a time: a policy's engine opens, answers, closes and hands its memory back
(`release_cached_memory`) before the next one opens, so the gate stage never holds more than
one engine beside the models it scores and measures KL with. A policy is asked in tiers: every
prompt of the first looks (the eval prompts' and each regression suite's) in one session, which
the gate stage runs before it loads those models; the rest of the look budget in a second
session, only if a later look asks for one of them. An engine opens at most twice per policy.
On a GPU the gate stage gives one tier, the whole budget (`gate_models.evaluate_on`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_core.rollout.factory import Engine, release_cached_memory

# (model directory, max_num_seqs, max_model_len) -> an engine on that model
EngineOpener = Callable[[Path, int, int], Engine]
MAX_NUM_SEQS = 256  # sequences an engine decodes together


@dataclass(frozen=True)
class Answers:
    """One policy's greedy answers to the eval prompts, with the prompts that failed."""

    texts: list[str]
    failed_prompts: list[int]


def isolating_failures(generate: Callable[[list[str]], list[str]], prompts: Sequence[str], batch_size: int) -> Answers:
    """`generate`'s answers to `prompts`, `batch_size` at a time; a batch that raises is retried
    prompt by prompt, and a prompt that still raises is recorded as failed with an empty answer."""
    texts: list[str] = []
    failed: list[int] = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start : start + batch_size])
        try:
            texts += generate(chunk)
            continue
        except Exception:  # noqa: BLE001 - isolate the prompts that fail below
            pass
        for i, prompt in enumerate(chunk):
            try:
                texts += generate([prompt])
            except Exception:  # noqa: BLE001 - a failure is a figure, not a crash
                texts.append("")
                failed.append(start + i)
    return Answers(texts, failed)


@dataclass
class ServedAnswers:
    """A policy's greedy answers of `max_new_tokens` from engines `open_engine` opens on
    `model_dir`, asked tier by tier of `tiers` (the prompts the gates may ask, the first looks'
    first) and remembered by prompt."""

    model_dir: Path
    open_engine: EngineOpener
    max_new_tokens: int
    max_model_len: int
    tiers: tuple[tuple[str, ...], ...]
    texts: dict[str, str | None] = field(default_factory=dict)  # None: its generation failed
    sessions: int = 0  # engines opened so far

    def answer(self, prompts: Sequence[str], max_new_tokens: int) -> Answers:
        """The answers to `prompts`; an engine opens for the tiers up to the last one that holds
        a prompt not answered yet (and for a prompt of no tier)."""
        if max_new_tokens != self.max_new_tokens:
            raise ValueError(f"{self.model_dir}: answers of {self.max_new_tokens} tokens, asked for {max_new_tokens}")
        missing = [p for p in dict.fromkeys(prompts) if p not in self.texts]
        if missing:
            self._generate(self._session(missing))
        texts = [self.texts[p] for p in prompts]
        return Answers([text or "" for text in texts], [i for i, text in enumerate(texts) if text is None])

    def _session(self, missing: list[str]) -> list[str]:
        wanted = set(missing)
        last = max((i for i, tier in enumerate(self.tiers) if wanted.intersection(tier)), default=-1)
        todo = dict.fromkeys(missing)
        for tier in self.tiers[: last + 1]:
            todo.update(dict.fromkeys(p for p in tier if p not in self.texts))
        return list(todo)

    def _generate(self, prompts: list[str]) -> None:
        engine = self.open_engine(self.model_dir, min(MAX_NUM_SEQS, len(prompts)), self.max_model_len)
        self.sessions += 1
        try:
            def greedy(chunk: list[str]) -> list[str]:
                rollouts = engine.generate(chunk, n=1, temperature=0.0, max_tokens=self.max_new_tokens)
                return [r.response_text for r in rollouts]

            out = isolating_failures(greedy, prompts, MAX_NUM_SEQS)
        finally:
            engine.close()
            release_cached_memory()
        failed = set(out.failed_prompts)
        self.texts.update((p, None if i in failed else text) for i, (p, text) in enumerate(zip(prompts, out.texts)))
