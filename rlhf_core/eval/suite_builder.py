"""Build a regression suite from candidate questions: keep those a model answers right robustly.

A regression gate compares a candidate with its reference on questions the reference gets right.
A question the reference gets right only narrowly flips under any change of its weights,
harmless ones included, and then measures decoding luck, not knowledge. SmolLM2-135M-Instruct
asked "What is the capital of France?" starts its greedy answer with "The" at probability 0.152
against "L" at 0.140; after twenty GRPO steps on sums (LoRA or full fine-tuning) it starts with
"L'Étoile, la Marseillaise, ...". Both candidates answer "Paris" when sampled often enough.

So a question is kept when the model's greedy answer is right AND at least `min_right` of
`samples` answers sampled at `temperature` are right; the rest are dropped, and the summary
says how many of each. Run it on the base model (the reference of your runs):

    python -m rlhf_core.eval.suite_builder QUESTIONS.jsonl MODEL_DIR OUT.jsonl \\
        [--checker answer_in_response] [--samples 8] [--min-right 7] [--temperature 0.7] [--max-tokens 32]

QUESTIONS is a suite file (one JSON object a line: `prompt`, text or messages, and `answer`);
conversational prompts are rendered with the model's chat template, as the gates ask them.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.chat import render_prompt
from rlhf_core.data.schema import write_jsonl
from rlhf_core.eval.regression import needs_answers, read_suite
from rlhf_core.training.verifiable import check_answers

MAX_NUM_SEQS = 256  # sequences the engine decodes together; more questions x samples run in waves


@dataclass(frozen=True)
class SuiteBuild:
    """What the builder kept, and why it dropped the rest."""

    questions: int
    kept: int
    wrong_greedy: int  # the greedy answer is wrong: not a capability the model has
    fragile: int  # right greedily, but fewer than min_right of the samples are

    def to_dict(self) -> dict[str, int]:
        return {"questions": self.questions, "kept": self.kept, "wrong_greedy": self.wrong_greedy,
                "fragile": self.fragile}


def robust(greedy_right: Sequence[bool], sampled_right: Sequence[Sequence[bool]], min_right: int) -> list[bool]:
    """Per question: right greedily and in at least `min_right` of its samples."""
    if len(greedy_right) != len(sampled_right):
        raise ValueError(f"{len(greedy_right)} greedy answers for {len(sampled_right)} sampled questions")
    return [g and sum(s) >= min_right for g, s in zip(greedy_right, sampled_right)]


def build_suite(questions: Path, model_dir: Path, out: Path, checker: str = "answer_in_response", samples: int = 8,
                min_right: int = 7, temperature: float = 0.7, max_tokens: int = 32, seed: int = 0) -> SuiteBuild:
    """Answer every question of `questions` with the model in `model_dir` (greedy once, then
    `samples` times at `temperature`) and write the robust ones to `out` (atomically)."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - heavy

    from rlhf_core.rollout.vllm_engine import RolloutEngine  # noqa: PLC0415 - starts vLLM

    if not 1 <= min_right <= samples:
        raise ValueError(f"--min-right must be between 1 and --samples ({samples}), got {min_right}")
    prompts, answers = read_suite(questions, answers_needed=needs_answers(checker))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    texts = [render_prompt(tokenizer, p) for p in prompts]
    longest = max(len(ids) for ids in tokenizer(texts)["input_ids"])  # the KV cache for these lengths only
    with RolloutEngine(model_dir, seed=seed, max_num_seqs=min(len(texts) * samples, MAX_NUM_SEQS),
                       max_model_len=longest + max_tokens + 1) as engine:
        greedy = [r.response_text for r in engine.generate(texts, n=1, temperature=0.0, max_tokens=max_tokens)]
        sampled = [r.response_text for r in engine.generate(texts, n=samples, temperature=temperature,
                                                            max_tokens=max_tokens, seed=seed)]
    greedy_right = check_answers(texts, greedy, answers, checker, where=f"--checker {checker}")
    flat = check_answers([t for t in texts for _ in range(samples)], sampled,
                         [a for a in answers for _ in range(samples)], checker, where=f"--checker {checker}")
    sampled_right = [flat[i * samples:(i + 1) * samples] for i in range(len(texts))]
    keep = robust(greedy_right, sampled_right, min_right)
    write_jsonl([{"prompt": p} | ({} if a is None else {"answer": a}) for p, a, k in zip(prompts, answers, keep) if k],
                out)
    return SuiteBuild(len(prompts), sum(keep), greedy_right.count(False), sum(g and not k for g, k in
                                                                           zip(greedy_right, keep)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("questions", type=Path)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--checker", default="answer_in_response")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--min-right", type=int, default=7)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    built = build_suite(args.questions, args.model_dir.expanduser(), args.out, args.checker, args.samples,
                        args.min_right, args.temperature, args.max_tokens, args.seed)
    print(json.dumps({"out": str(args.out), **built.to_dict()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
