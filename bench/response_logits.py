"""Memory of one policy update's forward and backward, with the LM head over every column and
with the head over the response columns only (`rlhf_core.models.logits`).

The model is the 111M-parameter Llama of `pretrained_scale.py` (14 layers, hidden 768, a
32,000-row vocabulary, tied embeddings), random weights; a micro-batch of 16 sequences of a
prompt of P tokens and a 16-token response. Each (variant, P) runs in a fresh process, which
reports its peak resident memory above what it held once the model and batch were built
(`ru_maxrss`, so the allocator's reuse and the step's transient tensors are both counted), the
seconds of the step, and the largest difference of the two variants' log-probs.

    .venv/bin/python bench/response_logits.py                 # P = 32, 128, 512
    .venv/bin/python bench/response_logits.py --prompts 64

Writes bench/results/response_logits.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import save, table  # noqa: E402

RESPONSE = 16
MICRO_BATCH = 16

CHILD = r"""
import json, resource, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from rlhf_core.training.policy_step import PolicyBatch, policy_logprobs

prompt, response, rows, variant = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
config = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=14, num_attention_heads=12,
                     num_key_value_heads=3, vocab_size=32000, tie_word_embeddings=True, max_position_embeddings=1024)
model = LlamaForCausalLM(config)


class AllColumns(torch.nn.Module):  # a forward without `logits_to_keep`: the head over every column
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask)


actor = AllColumns(model) if variant == "every_column" else model
L = prompt + response
g = torch.Generator().manual_seed(1)
input_ids = torch.randint(3, 32000, (rows, L), generator=g)
# prompts of P - 0..3 tokens, right padded, as build_batch makes them
lengths = [prompt - (b % 4) for b in range(rows)]
attention = torch.zeros((rows, L), dtype=torch.long)
positions = torch.zeros((rows, response), dtype=torch.long)
for b, p in enumerate(lengths):
    attention[b, : p + response] = 1
    positions[b] = p - 1 + torch.arange(response)
response_ids = torch.stack([input_ids[b, p : p + response] for b, p in enumerate(lengths)])
batch = PolicyBatch(input_ids, attention, positions, response_ids, torch.ones((rows, response)),
                    torch.zeros((rows, response)), torch.arange(rows))
base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
logprobs, _ = policy_logprobs(model if variant != "every_column" else actor, batch, temperature=1.0)
logprobs.sum().backward()
seconds = time.perf_counter() - start
peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"step_peak_gib": (peak_kib - base_kib) / 2**20, "seconds": seconds,
                  "logprobs": logprobs.detach()[:4].tolist()}))
"""


def run(prompt: int, variant: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(prompt), str(RESPONSE), str(MICRO_BATCH), variant],
                          capture_output=True, text=True, check=False, timeout=900,
                          env={"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "2",
                               "PATH": "/usr/bin:/bin"})
    if done.returncode != 0:
        raise SystemExit(f"{variant} P={prompt} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[32, 128, 512])
    args = parser.parse_args()
    rows = []
    for prompt in args.prompts:
        every, response_only = run(prompt, "every_column"), run(prompt, "response_columns")
        diff = max(abs(a - b) for ra, rb in zip(every["logprobs"], response_only["logprobs"]) for a, b in zip(ra, rb))
        rows.append({"prompt_tokens": prompt, "response_tokens": RESPONSE, "micro_batch": MICRO_BATCH,
                     "every_column_gib": round(every["step_peak_gib"], 3),
                     "response_columns_gib": round(response_only["step_peak_gib"], 3),
                     "memory_ratio": round(response_only["step_peak_gib"] / every["step_peak_gib"], 3),
                     "every_column_s": round(every["seconds"], 2), "response_columns_s": round(response_only["seconds"], 2),
                     "max_abs_logprob_diff": diff})
        print(table(rows[-1:], list(rows[-1])), flush=True)
    print(table(rows, list(rows[0])))
    print("written:", save("response_logits", {"model": "llama 111M (14 x 768, vocab 32000, tied)", "rows": rows}))


if __name__ == "__main__":
    main()
