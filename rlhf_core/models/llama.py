"""Tiny Llama-architecture causal LMs, created locally and saved in Hugging Face format.

The same directory loads with `AutoModelForCausalLM.from_pretrained(dir)` and with vLLM
(`LLM(model=dir)`): config.json, model.safetensors and the tokenizer files side by side.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rlhf_core.config import ModelConfig


def build_policy(cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised tiny Llama whose vocabulary matches `tokenizer`."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=cfg.initializer_range,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# Hugging Face's convention on the Hub: no file over 5 GB (a 7B model in bf16 is three shards
# and an index); transformers' own default is one file of up to 50 GB.
MAX_SHARD_SIZE = "5GB"


def save_pretrained_atomic(model, tokenizer: PreTrainedTokenizerFast, out_dir: Path, extra: dict | None = None,
                           dtype: torch.dtype | None = None) -> Path:
    """Save model + tokenizer in HF format (safetensors) so that `out_dir` appears complete or not at all.

    `extra` is written as `rlhf_meta.json` beside the weights (e.g. normalisation stats, lineage).
    `dtype`: the floating-point weights are saved in it (bf16 for a model trained in bf16, half
    the bytes of fp32) and config.json names it; by default as the model holds them. Weights
    over MAX_SHARD_SIZE are split into shards with an index.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True, max_shard_size=MAX_SHARD_SIZE,
                              state_dict=None if dtype is None else state_dict_in(model, dtype))
        if dtype is not None:
            config = json.loads((tmp / "config.json").read_text())
            config["dtype"] = str(dtype).removeprefix("torch.")
            config.pop("torch_dtype", None)
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(str(tmp))
        if extra is not None:
            (tmp / "rlhf_meta.json").write_text(json.dumps(extra, indent=2, sort_keys=True))
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def state_dict_in(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with floating-point tensors in `dtype`; tensors that share storage
    (tied embeddings and head) still share it, so the save writes them once."""
    cast: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    out = {}
    for name, tensor in model.state_dict().items():
        if not tensor.is_floating_point():
            out[name] = tensor
            continue
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in cast:
            cast[key] = tensor.detach().to(dtype)
        out[name] = cast[key]
    return out


def load_policy(path: Path | str) -> LlamaForCausalLM:
    return AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
