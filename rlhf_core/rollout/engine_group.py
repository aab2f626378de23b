"""Rollout engines of their own: `policy.rollout.placement: separate`.

By default the rollout engine lives in rank 0's worker, on its device (`RolloutEngine`). Past
one GPU that is the wrong shape: a 7B policy's engine wants whole GPUs to itself, several of
them (`tensor_parallel_size`) for a larger model, and several engines (`num_engines`) to
generate a step's rollouts in parallel. `EngineGroup` is the separate shape, as OpenRLHF's
`create_vllm_engines` and verl's rollout workers build it:

- each engine is a Ray actor (`EngineActor`) holding a `RolloutEngine`, in a placement group of
  its own: `tensor_parallel_size` bundles of one GPU and one CPU on one node (STRICT_PACK: a
  tensor-parallel engine's all-reduces stay on the node's links); on CPU one bundle of
  `tensor_parallel_size` CPUs. An engine of one GPU takes its GPU as the actor's own; a
  tensor-parallel engine starts its workers as Ray actors inside its placement group (vLLM's
  "ray" executor), the engine actor itself taking nothing. On CPU an engine of one process runs
  its model in the actor itself (vLLM's "uni" executor, `executor_backend`), with no worker
  process importing vLLM again beside it (docs/performance-notes.md, Rollout engine);
- `generate` splits the prompts into one contiguous share per engine and gathers the answers in
  prompt order. Each prompt keeps the seed it would have had in one engine (`prompt_seeds` of
  the whole batch), so seeded samples do not depend on the number of engines;
- `sync_weights` pushes the trainer's weights through the same transports as the colocated
  engine, to every engine at once (`RemoteEngines`): streamed over one process group of the
  trainer and every engine's workers (NCCL on GPUs, gloo on CPU), the trainer listening on its
  node's address; or a file, which needs every engine on the trainer's node (checked at start);
- `close` stops the engines and removes their placement groups, also when a start fails half
  way: nothing of the group outlives the stage (the actors' owner is the trainer's worker, so a
  killed worker takes them with it).

The group has `RolloutEngine`'s interface (`generate`, `sync_weights`, `release`, `close`),
which is all the policy loop uses.
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import ray
import torch
from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlhf_core.rollout.vllm_engine import Rollout, RolloutEngine, prompt_seeds
from rlhf_core.rollout.weight_sync import SafetensorsFileTransport, WeightTransport

START_TIMEOUT_S = 900.0  # an engine's model load and, on GPU, CUDA-graph capture


def shares(count: int, parts: int) -> list[tuple[int, int]]:
    """`count` items cut into `parts` contiguous [start, end) ranges whose sizes differ by at most
    one, the larger first (an engine with nothing to do gets an empty range)."""
    if parts < 1:
        raise ValueError(f"shares: {parts} parts")
    base, extra = divmod(count, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def executor_backend(tensor_parallel_size: int, use_gpu: bool) -> str | None:
    """vLLM's executor for an engine of a group. A tensor-parallel engine on GPUs: "ray" (its
    workers are actors in the engine's placement group). One engine process on CPU: "uni", the
    model in the actor's own process; a colocated engine keeps its worker out of the trainer's
    process (`vllm_engine`), which here is no reason: the actor holds nothing else, and a worker
    process of its own would import vLLM a second time. Otherwise None: vLLM's choice."""
    if tensor_parallel_size > 1:
        return "ray" if use_gpu else None
    return None if use_gpu else "uni"


class ReceivingEnd(WeightTransport):
    """The engine actor's side of a transport: the engine arguments the trainer's transport asks
    for (`engine_args`); the weights arrive from the trainer, never pushed from here."""

    def __init__(self, engine_args: dict[str, Any]):
        self.args = engine_args

    def engine_args(self) -> dict[str, Any]:
        return dict(self.args)

    def push(self, llm: Any, state_dict: Mapping[str, torch.Tensor]) -> None:
        raise RuntimeError("an engine of a group takes its weights from the trainer (EngineGroup.sync_weights)")


class EngineActor:
    """One engine of a group, in a Ray actor of its own (`ray.remote(EngineActor)`)."""

    def __init__(self, model_dir: str, transport_args: dict[str, Any], kwargs: dict[str, Any]):
        if kwargs.get("distributed_executor_backend") == "ray":
            # Ray hid every GPU from this actor (it asked for none); vLLM's Ray executor places its
            # workers in the placement group itself and must not inherit the empty mask (OpenRLHF's
            # LLMRayActor does the same)
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        self.engine = RolloutEngine(model_dir, transport=ReceivingEnd(transport_args), **kwargs)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def workers(self) -> int:
        from rlhf_core.rollout.weight_transfer import engine_workers  # noqa: PLC0415

        return engine_workers(self.engine._engine())

    def generate(self, prompts: Sequence[str], kwargs: dict[str, Any]) -> list[Rollout]:
        return self.engine.generate(prompts, **kwargs)

    def collective_rpc(self, method: str, timeout: float | None, args: tuple) -> list[Any]:
        return self.engine._engine().collective_rpc(method, timeout=timeout, args=args)

    def probe(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        [answer] = self.engine.probe(prompt_ids, response_ids)
        return answer

    def reset_prefix_cache(self) -> None:
        self.engine._engine().reset_prefix_cache()

    def close(self) -> None:
        self.engine.close()


class RemoteEngines:
    """Every engine of a group seen as one engine's `collective_rpc`, which is all the transports
    call: each call runs on every worker of every engine, and the answers come back in order.

    The streamed transport's handshake gives the workers their ranks in the trainer's group: rank
    `rank_offset` + the worker's rank within its engine. One engine's workers start at the
    trainer's offset (1); engine i's start `workers` x i further on."""

    def __init__(self, actors: Sequence[Any], workers_per_engine: int):
        self.actors, self.workers_per_engine = list(actors), workers_per_engine

    @property
    def engine_workers(self) -> int:  # read by `weight_transfer.engine_workers`
        return len(self.actors) * self.workers_per_engine

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = ()) -> list[Any]:
        calls = []
        for i, actor in enumerate(self.actors):
            call_args = args
            if method == "init_weight_transfer_engine":
                [info] = args
                call_args = ({**info, "rank_offset": info["rank_offset"] + i * self.workers_per_engine},)
            calls.append(actor.collective_rpc.remote(method, timeout, call_args))
        return [answer for answers in ray.get(calls, timeout=timeout) for answer in answers]


def _taken_over(name: str, timeout_s: float) -> str:
    """`name`, free: a placement group of that name (an earlier attempt's) removed and waited for."""
    try:
        left = get_placement_group(name)
    except ValueError:
        return name
    remove_placement_group(left)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            get_placement_group(name)
        except ValueError:
            return name
        time.sleep(0.2)
    raise RuntimeError(f"the placement group {name!r} of an earlier attempt was not removed within {timeout_s:g} s")


class EngineGroup:
    """`num_engines` engines of `tensor_parallel_size` devices each, as Ray actors in placement
    groups of their own (`bundles` each, as the trainer's cluster reserved them:
    `cluster.engine_bundles`), taking weights through `transport` (`weight_sync`, `weight_transfer`).
    The groups are named `name`-i, a run's own: a group of that name still there was left by the
    run's previous attempt (a killed worker's groups outlive it until Ray collects them) and is
    removed before the new one is made."""

    def __init__(self, model_dir: str, *, num_engines: int, tensor_parallel_size: int, use_gpu: bool,
                 bundles: list[dict[str, float]], transport: WeightTransport, seed: int = 0, start_timeout_s: float = START_TIMEOUT_S,
                 name: str = "rollout-engine", **engine_kwargs: Any):
        start = time.perf_counter()
        self.transport = transport
        self.max_model_len = engine_kwargs.get("max_model_len")
        self.groups: list[Any] = []
        self.actors: list[Any] = []
        try:
            remote = ray.remote(EngineActor)
            kwargs = dict(engine_kwargs, tensor_parallel_size=tensor_parallel_size,
                          distributed_executor_backend=executor_backend(tensor_parallel_size, use_gpu))
            for i in range(num_engines):
                group = placement_group(bundles, strategy="STRICT_PACK", name=_taken_over(f"{name}-{i}", start_timeout_s))
                self.groups.append(group)
                self._wait_placed(group, i, bundles, start_timeout_s)
                own_gpu = use_gpu and tensor_parallel_size == 1
                self.actors.append(remote.options(
                    num_cpus=0 if use_gpu and tensor_parallel_size > 1 else bundles[0]["CPU"],
                    num_gpus=1 if own_gpu else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True),
                ).remote(str(model_dir), transport.engine_args(), dict(kwargs, seed=seed + i)))
            workers = ray.get([a.workers.remote() for a in self.actors], timeout=start_timeout_s)
            if isinstance(transport, SafetensorsFileTransport):
                self._check_same_node()
        except BaseException:
            self.close()
            raise
        self.engines = RemoteEngines(self.actors, workers[0])
        self.start_seconds = time.perf_counter() - start
        self.last_metrics: dict[str, float] = {"rollout/engine_start_s": self.start_seconds}

    @staticmethod
    def _wait_placed(group: Any, index: int, bundles: list[dict[str, float]], timeout_s: float) -> None:
        if group.wait(timeout_seconds=timeout_s):
            return
        raise RuntimeError(
            f"rollout engine {index}: its placement group {bundles} "
            f"(STRICT_PACK, one node) found no room within {timeout_s:g} s; the cluster has "
            f"{ray.cluster_resources()}, {ray.available_resources()} of it free: lower policy.rollout.num_engines or "
            "policy.rollout.tensor_parallel_size, or policy.num_workers, or add nodes")

    def _check_same_node(self) -> None:
        here = ray.get_runtime_context().get_node_id()
        nodes = ray.get([a.node_id.remote() for a in self.actors])
        away = [i for i, node in enumerate(nodes) if node != here]
        if away:
            raise RuntimeError(
                f"policy.rollout.weight_sync: file writes the weights on the trainer's node, but engines {away} run on "
                "other nodes; set policy.rollout.weight_sync: stream")

    def generate(self, prompts: Sequence[str], n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 max_tokens: int = 16, seed: int | None = None, min_tokens: int = 0) -> list[Rollout]:
        """`RolloutEngine.generate` over the group: each engine answers a contiguous share of the
        prompts, with the seeds those prompts have in the whole batch."""
        seeds = prompt_seeds(seed, len(prompts)) if seed is not None else None
        start = time.perf_counter()
        calls = []
        for actor, (a, b) in zip(self.actors, shares(len(prompts), len(self.actors))):
            if a == b:
                continue
            kwargs = {"n": n, "temperature": temperature, "top_p": top_p, "max_tokens": max_tokens,
                      "min_tokens": min_tokens, "seeds": seeds[a:b] if seeds is not None else None}
            calls.append((a, actor.generate.remote(list(prompts[a:b]), kwargs)))
        rollouts: list[Rollout] = []
        for offset, call in calls:
            share = ray.get(call)
            rollouts += [replace(r, group=r.group + offset) for r in share]
        seconds = time.perf_counter() - start
        tokens = sum(len(r.response_token_ids) for r in rollouts)
        self.last_metrics.update({"rollout/gen_s": seconds, "rollout/gen_tokens": tokens,
                                  "rollout/tokens_per_s": tokens / seconds if seconds > 0 else 0.0})
        return rollouts

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor] | torch.nn.Module) -> float:
        """Every engine takes `state_dict` (Hugging Face names; or the trainer's module, through a
        streaming transport, as `RolloutEngine.sync_weights`); the seconds taken."""
        start = time.perf_counter()
        self.transport.push(self.engines, state_dict)
        ray.get([a.reset_prefix_cache.remote() for a in self.actors])
        seconds = time.perf_counter() - start
        self.last_metrics["rollout/sync_s"] = seconds
        return seconds

    def probe(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]) -> list[list[list[float]]]:
        """`RolloutEngine.probe` on every engine of the group: each must hold the trainer's weights."""
        rows = ([list(p) for p in prompt_ids], [list(r) for r in response_ids])
        return ray.get([a.probe.remote(*rows) for a in self.actors])

    def release(self) -> None:
        """Engines of their own hold their devices through the update: nothing to free."""

    def close(self, timeout: float = 60.0) -> None:
        """Stop every engine and remove the placement groups. Idempotent."""
        actors, self.actors = self.actors, []
        groups, self.groups = self.groups, []
        try:
            if actors:
                try:
                    ray.get([a.close.remote() for a in actors], timeout=timeout)
                except Exception:  # noqa: BLE001 - an engine that died or hangs is killed below all the same
                    pass
                for actor in actors:
                    ray.kill(actor)
        finally:
            for group in groups:
                remove_placement_group(group)
            self.transport.close()

    def __enter__(self) -> "EngineGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
