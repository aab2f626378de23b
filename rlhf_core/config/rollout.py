"""The configs of the rollouts of policy optimisation: the vLLM engines that sample them
(`policy.rollout`) and pipelined rollouts (`policy.pipeline`), re-exported by `rlhf_core.config`."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_core.config.inputs import _Strict


class RolloutPipelineConfig(_Strict):
    """Pipelined rollouts (`rlhf_core.rollout.pipeline`): the engine generates the next steps'
    batches while the trainer updates on the current one, taking new weights in flight.

    max_lag 0 is the synchronous loop (generate, then train, then sync). With max_lag k the
    batch of step s may be sampled by a policy up to k updates older than the one it trains
    (s - 1 - k instead of s - 1); each token's loss is then weighted by the truncated
    importance ratio min(pi_old / mu, is_cap) of the trainer's policy to the sampler's.
    """

    max_lag: int = Field(0, ge=0, le=8,
        description='Policy updates a rollout batch may lag behind the policy it trains; 0: synchronous.')
    is_cap: float = Field(2.0, ge=1, description='Truncation of the per-token importance weight of lagged samples.')
    chunks: int = Field(2, ge=1, description='Generate calls per batch; new weights are taken between them.')


class RolloutEngineConfig(_Strict):
    """The vLLM engines that sample the rollouts, taking the trainer's weights after every
    update: one engine in rank 0's worker, on its device (colocated); or engines of their own,
    Ray actors on devices of their own (separate, `rlhf_core.rollout.engine_group`). Their
    context (and on CPU their KV cache) is sized from the run's prompts and `max_new_tokens`,
    not set here."""

    placement: Literal["colocated", "separate"] = Field("colocated", description=(
        "colocated: one engine inside rank 0's worker, sharing its device (sleep frees the device during the "
        "update). separate: num_engines engines as Ray actors, each in a placement group of its own with "
        "tensor_parallel_size GPUs (on CPU, that many CPUs) beside the trainer's workers; the cluster must hold "
        "both."))
    num_engines: int = Field(1, ge=1, description=(
        "Engines generating a step's rollouts together, each on a share of the prompts (placement: separate)."))
    tensor_parallel_size: int = Field(1, ge=1, description=(
        "GPUs each engine splits the model over (placement: separate; vLLM's tensor parallelism, on one node)."))

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description=(
        "What the engine computes in. auto: bfloat16 on GPU when the trainer computes in bf16 (policy.precision), "
        "else float32 (on CPU always: the engine's log-probs then match the trainer's within rounding)."))
    gpu_memory_utilization: float | None = Field(None, gt=0, le=0.95, description=(
        "Share of the GPU's memory the engine takes for its weights, activations and KV cache; beside the trainer "
        "(colocated) the trainer's weights, optimizer and activations need the rest. null: sized from the run, "
        "the weights plus the KV cache of a step's rollouts at the engine's context plus 2 GiB "
        "(rlhf_core/models/engine_share.py), 0.9 on GPUs of its own. Not used on CPU."))
    enforce_eager: bool | None = Field(None, description=(
        "true: no CUDA graphs (less memory, slower decoding); null: eager on CPU, CUDA graphs on GPU."))
    sleep: bool | None = Field(None, description=(
        "Free the engine's GPU memory (weights and KV cache, vLLM's sleep mode) while the trainer scores and "
        "updates, taking it back at the weight sync. null: on GPU unless rollouts are pipelined "
        "(policy.pipeline.max_lag > 0, the engine then generates during the update); never on CPU, where vLLM "
        "has no sleep mode."))
    weight_sync: Literal["auto", "file", "stream"] = Field("auto", description=(
        "How the trainer's weights reach the engine after each update. file: one safetensors file in /dev/shm, "
        "read back by the engine; stream: tensor by tensor through vLLM's weight-transfer API (on GPU: CUDA IPC "
        "when the engine is colocated on the trainer's GPU, NCCL to engines of their own; gloo on CPU), in the "
        "engine's dtype, each parameter read from the trainer's module (gathered under ZeRO-3; LoRA's merged as "
        "sent) with no copy of the model (pipelined: from a copy on rank 0's host); auto: stream on GPU, file on "
        "CPU."))
    sync_timeout_s: float = Field(300.0, gt=0, description=(
        "Seconds a weight sync may take before the stage fails with a timeout (a hung transfer otherwise holds "
        "the run's workers forever)."))
    verify_sync: bool = Field(True, description=(
        "After every weight sync, score a few of the step's rollouts with the engine and with the trainer and stop "
        "the run (after one retried sync) when their token probabilities differ by more than the circuit breaker's "
        "bound for the trainer's precision, or when the engine did not move from the SFT weights with the trainer: "
        "a sync that silently did nothing. Not with pipelined rollouts."))
    check_sync: bool = Field(False, description=(
        "After the first and the last weight sync, compare the engine's greedy answers to 32 held-out prompts "
        "with the trainer's own and keep the comparison with the stage's result: a diagnostic for a new model "
        "family, dtype or transport."))
