"""The TRL side of bench/rl_step_vs_trl.py: runs in TRL's own virtual environment (no project
imports). GRPO with TRL's `GRPOTrainer` on a local model directory, the same prompts and the
same verifiable reward; prints per-step wall times as JSON on the last line."""
from __future__ import annotations

import json
import re
import sys
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

_ADDITION = re.compile(r"^\s*(\d+)\+(\d+)=\s*$")


def exact_match(prompts, completions, **_) -> list[float]:
    """The project's `addition_exact_match`, restated: 1.0 for the zero-padded sum."""
    out = []
    for p, c in zip(prompts, completions):
        a, b = _ADDITION.match(p).groups()
        out.append(float(c.strip() == f"{int(a) + int(b):0{max(len(a), len(b)) + 1}d}"))
    return out


class StepTimes(TrainerCallback):
    def __init__(self):
        self.marks = [time.perf_counter()]

    def on_step_end(self, args, state, control, **kwargs):
        self.marks.append(time.perf_counter())


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    tok.padding_side = "left"
    data = Dataset.from_dict({"prompt": spec["prompts"]})
    cfg = GRPOConfig(
        output_dir=spec["out_dir"], use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        logging_steps=1, max_steps=spec["steps"], learning_rate=spec["learning_rate"], beta=spec["kl_coef"],
        num_generations=spec["group_size"], per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=spec["completions_per_step"] // spec["micro_batch"], num_iterations=1,
        max_completion_length=spec["tokens"], temperature=1.0, top_p=1.0, top_k=0, seed=0,
        dataloader_num_workers=0, gradient_checkpointing=False,  # ours does not recompute activations either
    )
    times = StepTimes()
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=[exact_match], args=cfg,
                          train_dataset=data, callbacks=[times])
    trainer.train()
    steps = [b - a for a, b in zip(times.marks, times.marks[1:])]
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    print(json.dumps({"step_s": steps, "response_length": lengths, "trl": __import__("trl").__version__,
                      "transformers": __import__("transformers").__version__}))


if __name__ == "__main__":
    main()
