"""LoRA adapters for the policy (`policy.lora`), with `peft`.

The policy's base weights stay frozen; low-rank adapters on `target_modules` are all that
trains, so the optimizer holds state for the adapters only, and the reference policy is the
same model with its adapters switched off (`reference_view`): no second copy of the weights.
What leaves the stage is a plain Hugging Face model with the adapters merged into its weights
(`merged_policy`), which vLLM loads like any other; during PPO and GRPO the rollout engine
follows the trainer through the same merge, computed without touching the trained model
(`merged_state_dict`).

peft itself only complains when none of the target modules exists; `check_target_modules`
refuses each one that matches nothing, naming the model's own linear modules.
"""
from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlhf_core.config import LoRAConfig
from rlhf_core.models.llama import load_policy
from rlhf_core.models.placement import frozen_on

if TYPE_CHECKING:
    from peft import PeftModel

ALL_LINEAR = "all-linear"  # peft's name for every linear layer but the output head


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last components of the names of the model's linear layers (q_proj, ...)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def check_target_modules(model: torch.nn.Module, targets: str | Sequence[str]) -> None:
    """Raise ValueError naming every target that matches no module of `model` (a target matches
    a module whose name is the target or ends with "." + target), and the model's linear modules."""
    if targets == ALL_LINEAR:
        return
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise ValueError(
            f"policy.lora.target_modules: {', '.join(repr(t) for t in missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not a module of the model ({type(model).__name__}); "
            f"its linear modules are {', '.join(linear_module_names(model))}, or use {ALL_LINEAR!r}")


def is_lora_model(model: Any) -> bool:
    """Whether `model` is a PeftModel. peft is imported where adapters are made (`with_lora`), so a
    process that never imported it holds none: a rollout engine's worker, which only receives
    weights, is spared the import."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def with_lora(model: torch.nn.Module, cfg: LoRAConfig) -> PeftModel:
    """`model` with LoRA adapters on `cfg.target_modules` (checked first); only they train."""
    from peft import LoraConfig as PeftLoraConfig  # noqa: PLC0415 - see is_lora_model
    from peft import get_peft_model  # noqa: PLC0415
    targets = cfg.target_modules if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
    check_target_modules(model, targets)
    config = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                            task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def load_policy_for_training(path: Path | str, cfg: LoRAConfig, gradient_checkpointing: bool = False
                             ) -> torch.nn.Module:
    """The policy in `path`, with LoRA adapters when `cfg.enabled`, and with gradient
    checkpointing when asked: each decoder layer's activations are recomputed in the backward
    pass instead of kept from the forward one (less memory, about one more forward pass of
    compute; it acts in training mode only)."""
    model = load_policy(path)
    if gradient_checkpointing:
        model.config.use_cache = False  # a cache is of no use when training, and HF refuses it with checkpointing
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return with_lora(model, cfg) if cfg.enabled else model


def merged_entries(model: PeftModel, tied_once: bool = False) -> list[tuple[str, torch.Tensor, Any]]:
    """(plain name, base tensor, its LoRA layer or None) for every tensor of the plain model that
    `model` (a PeftModel) computes as: what `merged_weights` merges, known without merging. With
    `tied_once` a tied head (the embeddings' own tensor) is listed once, under the first name."""
    from peft.tuners.lora import LoraLayer  # noqa: PLC0415

    base = model.get_base_model()
    layers = {f"{name}.weight": module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    seen: set[int] = set()
    out = []
    for key, value in base.state_dict(keep_vars=True).items():
        if ".lora_" in key or (tied_once and id(value) in seen):
            continue
        seen.add(id(value))
        plain = key.replace(".base_layer.", ".")
        out.append((plain, value, layers.get(plain)))
    return out


@torch.no_grad()
def merged_weights(model: PeftModel, tied_once: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain model's tensors one at a time, in fp32 on the model's device: every adapted
    layer's base weight plus its adapters' delta (scaling x B @ A). Each is a new tensor;
    `model` itself is left as it is (no merge and unmerge, whose rounding would drift the base
    weights over a run)."""
    for plain, value, layer in merged_entries(model, tied_once):
        weight = value.detach().to(torch.float32, copy=True)
        if layer is not None:
            for adapter in layer.active_adapters:
                weight += layer.get_delta_weight(adapter).float()
        yield plain, weight


def merged_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """The state dict of the plain model that computes what `model` (a PeftModel) computes,
    under the plain model's names, as fp32 CPU copies (`merged_weights`)."""
    return {name: weight.cpu() for name, weight in merged_weights(model)}


def frozen_reference(sft_dir: Path | str, cfg: LoRAConfig, device: torch.device | str) -> torch.nn.Module | None:
    """The frozen reference a trainer compares against: None with LoRA (the actor with its
    adapters off, `reference_view`: no copy), else the SFT policy frozen on the actor's `device`
    (`placement.frozen_on`: bf16 on a GPU), where its log-probs meet the actor's."""
    return None if cfg.enabled else frozen_on(load_policy(sft_dir), device)


@contextmanager
def reference_view(policy: torch.nn.Module, reference: torch.nn.Module | None) -> Iterator[torch.nn.Module]:
    """The reference policy: `reference` when there is a separate copy, else `policy` (a
    PeftModel, or a DeepSpeed engine around one) with its adapters switched off."""
    if reference is not None:
        yield reference
        return
    model = getattr(policy, "module", policy)  # through a DeepSpeed engine
    with model.disable_adapter():
        yield model


def merged_policy(path: Path | str, cfg: LoRAConfig, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The trained policy as a plain model: the base in `path`, the trained parameters in
    `state_dict` (named as the training model names them: with LoRA, the PeftModel's names),
    and with LoRA the adapters merged into the base weights."""
    model = load_policy_for_training(path, cfg)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = sorted(set(missing) - tied_aliases(model))  # a tied head is the embeddings' tensor, loaded under their name
    if missing or unexpected:
        raise RuntimeError(f"the trained weights do not fit the model in {path}: missing {missing}, "
                           f"unexpected {sorted(unexpected)}")
    return model.merge_and_unload() if cfg.enabled else model


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """The names under which a parameter appears a second time (a head tied to the embeddings).
    `named_parameters()`, and so DeepSpeed's gather of the full parameters, lists each once."""
    return ({name for name, _ in model.named_parameters(remove_duplicate=False)}
            - {name for name, _ in model.named_parameters()})
