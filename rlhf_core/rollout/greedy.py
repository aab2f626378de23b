"""Greedy answers of vLLM's engine on a model directory, for comparing with the trainer's model
(`rlhf_core.models.gguf_import.greedy_agreement`). The engine is the rollouts' own
(`RolloutEngine`: float32, eager, a CPU KV cache sized for exactly these prompts), so what is
checked is what the policy stage runs."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.rollout.vllm_engine import RolloutEngine


@dataclass(frozen=True)
class GreedyAnswer:
    prompt_ids: list[int]  # as vLLM encoded the prompt text
    response_ids: list[int]  # ends with EOS when the answer ended before max_new_tokens


def vllm_greedy(model_dir: str | Path, prompts: Sequence[str], max_new_tokens: int,
                max_model_len: int = 512) -> list[GreedyAnswer]:
    """Temperature-0 answers to the prompt texts, in order. Builds an engine and closes it;
    call under `if __name__ == "__main__":` (vLLM starts its worker with spawn)."""
    with RolloutEngine(model_dir, dtype="float32", seed=0, max_model_len=max_model_len,
                       max_num_seqs=max(1, len(prompts))) as engine:
        rollouts = engine.generate(list(prompts), n=1, temperature=0.0, max_tokens=max_new_tokens)
    return [GreedyAnswer(r.prompt_token_ids, r.response_token_ids) for r in rollouts]
