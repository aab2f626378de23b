"""What the trainers do with DeepSpeed: its import and ops cache, an engine's config, one
backward-and-step of a pre-normalised loss, and the full weights gathered from the ranks."""
from __future__ import annotations

import importlib
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlhf_core.models.placement import is_partitioned, module_entries
from rlhf_core.training.policy_step import StepOutcome, guard_nonfinite
from rlhf_core.training.sft import warmup_cosine

if TYPE_CHECKING:
    from rlhf_core.config import PolicyConfig


def saved_dtype(use_gpu: bool) -> torch.dtype | None:
    """The dtype a stage saves its model in: bf16 where DeepSpeed computes in bf16 (on GPUs; half
    the bytes of fp32, and what vLLM serves there); None on CPU: as trained, fp32."""
    return torch.bfloat16 if use_gpu else None


def deepspeed_config(
    *, train_batch_size: int, micro_batch_size: int, grad_accum_steps: int, max_grad_norm: float, zero_stage: int,
    learning_rate: float, weight_decay: float, use_gpu: bool,
) -> dict[str, Any]:
    """The DeepSpeed config of every trainer (reward, PPO/GRPO actor and critic, DPO/KTO): one
    optimizer step per `train_batch_size` sequences (all ranks and micro-batches together), ZeRO
    `zero_stage`, AdamW at a constant `learning_rate` (schedules are passed to
    `deepspeed.initialize` as callables, `warmup_cosine_lr`), clipping at `max_grad_norm`; bf16 on
    GPU, fp32 on CPU. The optimizer is torch's AdamW everywhere (`torch_adam`), fused on GPU:
    DeepSpeed's FusedAdam is compiled on first use and needs `nvcc`, which a runtime image of
    torch's CUDA wheels does not have; torch's fused kernel ships with the wheel."""
    return {
        "train_batch_size": train_batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "gradient_clipping": max_grad_norm,
        "zero_optimization": {"stage": zero_stage},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": learning_rate, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": weight_decay,
                       "torch_adam": True, **({"fused": True} if use_gpu else {})},
        },
        "bf16": {"enabled": use_gpu},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def policy_engine(deepspeed, model: torch.nn.Module, cfg: PolicyConfig, learning_rate: float, use_gpu: bool):
    """A DeepSpeed engine of the actor or the critic whose optimizer holds the trainable parameters only (with
    LoRA: the adapters): one optimizer step per minibatch, a constant `learning_rate`, no weight decay."""
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=deepspeed_config(
                                          train_batch_size=cfg.minibatch_size, micro_batch_size=cfg.micro_batch_size,
                                          grad_accum_steps=cfg.grad_accum_steps, max_grad_norm=cfg.max_grad_norm,
                                          zero_stage=cfg.zero_stage, learning_rate=learning_rate, weight_decay=0.0,
                                          use_gpu=use_gpu))
    return engine


def warmup_cosine_lr(optimizer: torch.optim.Optimizer, total: int, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then cosine decay to 10%, as SFT (`rlhf_core.training.sft.warmup_cosine`);
    passed to `deepspeed.initialize` as `lr_scheduler` (bound with `functools.partial`), since
    DeepSpeed's WarmupLR / WarmupCosineLR give the first step lr 0."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, total, max(warmup, 1)))


def module_grad_norm(module: torch.nn.Module) -> float:
    """Global L2 norm of the module's gradients (without ZeRO, DeepSpeed does not keep it)."""
    norms = [p.grad.detach().float().norm() for p in module.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)).item() if norms else float("nan")


class DeepSpeedBackwardAndStep:
    """`BackwardAndStep` (`rlhf_core.training.policy_step`) for a DeepSpeed engine. The loss
    arrives normalised by the whole minibatch (micro-batch losses sum to it), so DeepSpeed must
    not divide it again by the accumulation steps. A non-finite loss is poisoned to NaN
    gradients, which ZeRO's invalid-gradient-norm check turns into a skipped step on every
    rank (`skipped_steps`)."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, loss: torch.Tensor, boundary: bool) -> StepOutcome | None:
        engine = self.engine
        engine.backward(guard_nonfinite(loss), scale_wrt_gas=False)
        if boundary != engine.is_gradient_accumulation_boundary():
            raise RuntimeError("micro-batches out of step with DeepSpeed's gradient accumulation")
        skipped = engine.skipped_steps
        engine.step()
        if not boundary:
            return None
        norm = engine.get_global_grad_norm()
        return StepOutcome(engine.skipped_steps == skipped, float(norm) if norm is not None else math.nan)


def gathered_module_state(engine, zero_stage: int, rank: int) -> dict[str, torch.Tensor] | None:
    """The module's full state dict (fp32, on CPU) on rank 0, None elsewhere. Every rank must
    call it: under ZeRO-3 the parameters are gathered by a collective, one at a time (as
    DeepSpeed's own 16-bit save and OpenRLHF's `broadcast_to_vllm` do), so a rank's device holds
    its shards plus one full parameter, never the whole model. Under ZeRO-1/2 every rank holds
    the full parameters already."""
    module = engine.module
    if zero_stage != 3:
        return _cpu_copy(module.state_dict()) if rank == 0 else None
    import deepspeed  # noqa: PLC0415

    out = {}
    for name, tensor in module.state_dict(keep_vars=True).items():  # the Parameters themselves, shards and all
        if is_partitioned(tensor):  # every rank takes part in its gather
            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
                if rank == 0:
                    out[name] = _cpu_tensor(tensor)
        elif rank == 0:  # a buffer: whole on every rank
            out[name] = _cpu_tensor(tensor)
    return out if rank == 0 else None


def follow_gathers(module: torch.nn.Module) -> None:
    """A rank other than 0 while rank 0 streams `weight_transfer.ModuleSource(module)`: the same ZeRO-3 gathers,
    in the same order, nothing sent. Nothing to do for a module that is not partitioned."""
    partitioned = [t for _, t in module_entries(module) if is_partitioned(t)]
    if not partitioned:
        return
    import deepspeed  # noqa: PLC0415

    for tensor in partitioned:
        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
            pass


def _cpu_copy(state_dict) -> dict[str, torch.Tensor]:
    return {k: _cpu_tensor(v) for k, v in state_dict.items()}


def _cpu_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().float().cpu().clone()


def full_fp32_parameters(engine, rank: int) -> dict[str, torch.Tensor] | None:
    """The optimizer's full fp32 parameters on rank 0 (None elsewhere). Every rank must call
    it: under ZeRO each parameter is assembled from the optimizer's fp32 partitions by a
    collective."""
    from deepspeed.utils import safe_get_full_fp32_param  # noqa: PLC0415

    out = {}
    for name, param in engine.module.named_parameters():
        full = safe_get_full_fp32_param(param)  # None without ZeRO: the module holds it whole
        if full is None:
            full = param.detach()
        if rank == 0:
            out[name] = full.detach().float().cpu().clone()
    return out if rank == 0 else None


def extensions_dir() -> Path:
    """Where DeepSpeed's just-in-time ops are built and cached: inside this Python environment.

    torch's default (~/.cache/torch_extensions) is shared by every environment of the user,
    and its build files name the environment's absolute paths, so two checkouts used in turn
    rebuild each other's ops; on CPU DeepSpeed builds its shared-memory collectives op in every
    training process, about 35 s on two cores when the cache is stale."""
    return Path(sys.prefix) / "torch_extensions"


def import_deepspeed(use_gpu: bool):
    """Import DeepSpeed in a training worker: on its CPU accelerator without GPUs (it picks the
    accelerator on first import), with ops cached per environment (`extensions_dir`).

    DeepSpeed's autotuner imports MLflow whenever it is installed, to log autotuning results we
    never ask for: a third of DeepSpeed's import time, paid by every training worker of every
    stage. A process that has not imported MLflow imports DeepSpeed with MLflow hidden (the
    autotuner then records that it has none), and MLflow imports normally afterwards.

    ZeRO imports DeepSpeed's Muon optimizer at its first gradient reduction, to ask whether the
    optimizer is Muon. That module wraps Muon's kernels in `torch.compile` as it loads, which
    imports the rest of torch's compiler (dynamo's debugging tools, functorch's partitioners,
    networkx): 1.2 CPU-s of every training worker. The optimizer here is always AdamW
    (`deepspeed_config`), so the module is imported once here with its kernels left as plain
    functions; ZeRO then finds it imported. Both are patches (`rlhf_core.patches`)."""
    if not use_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    hide_mlflow = "mlflow" not in sys.modules and "deepspeed" not in sys.modules
    if hide_mlflow:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError while this holds
    try:
        import deepspeed  # noqa: PLC0415
    finally:
        if hide_mlflow:
            del sys.modules["mlflow"]
    _import_muon_uncompiled()
    return deepspeed


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def _import_muon_uncompiled() -> None:
    """Import DeepSpeed's Muon optimizer module with `deepspeed.runtime.compiler.compile` a
    no-op decorator meanwhile (see `import_deepspeed`). Nothing to do once it is imported, or
    in a DeepSpeed without Muon."""
    if MUON_MODULE in sys.modules:
        return
    from deepspeed.runtime import compiler  # noqa: PLC0415

    compile_ = compiler.compile
    compiler.compile = lambda: (lambda fn: fn)
    try:
        importlib.import_module(MUON_MODULE)
    except ImportError:
        pass
    finally:
        compiler.compile = compile_


def build_deepspeed_ops() -> float:
    """Build (or find in the cache) the ops DeepSpeed loads at start-up on this machine's
    accelerator; run by `make setup` so that the first training stage does not pay for it.
    Returns the seconds taken."""
    import time  # noqa: PLC0415

    start = time.perf_counter()
    import_deepspeed(use_gpu=False)
    from deepspeed.comm.torch import build_shm_op  # noqa: PLC0415

    build_shm_op()
    return time.perf_counter() - start
