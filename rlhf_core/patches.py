"""Every change this project makes to another library's behaviour, in one list.

Each entry names the library, the version it was written against (the pin in constraints.txt),
what it changes, why, and the function that applies it. `tests/test_patches.py` holds a test per
entry that checks the upstream behaviour it works around is still there, and that the installed
version is the one named here: an upgrade fails that test and names the entries to re-check or
delete. Nothing is applied by `import rlhf_core`; each patch acts only where and while its
function says. What each one saves is measured in docs/performance-notes.md.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Patch:
    name: str
    library: str  # the import name
    version: str  # the version (major.minor) it was written and tested against
    applied_by: str  # module:function
    what: str
    why: str


PATCHES = (
    Patch("deepspeed_without_mlflow", "deepspeed", "0.19", "rlhf_core.distributed.deepspeed_engine:import_deepspeed",
          "DeepSpeed is imported with `import mlflow` failing (unless MLflow is already loaded)",
          "DeepSpeed's autotuner imports MLflow to log results never asked for: a third of DeepSpeed's "
          "import time in every training worker"),
    Patch("muon_uncompiled", "deepspeed", "0.19", "rlhf_core.distributed.deepspeed_engine:import_deepspeed",
          "DeepSpeed's Muon optimizer module is imported with `deepspeed.runtime.compiler.compile` a no-op",
          "ZeRO imports it at the first gradient reduction and it wraps its kernels in torch.compile, loading "
          "the rest of torch's compiler; the optimizer here is always AdamW"),
    Patch("vllm_rendezvous_dir", "vllm", "0.32", "rlhf_core.rollout.cpu_engine:rendezvous_in",
          "the executors' `get_file_store_init_method` names a file in the engine's own scratch directory",
          "otherwise torch's FileStore file goes to the temp directory, where a killed process leaves it"),
    Patch("vllm_keeps_host_group", "vllm", "0.32", "rlhf_core.rollout.cpu_engine:keeping_the_hosts_process_group",
          "while an in-process engine shuts down, `torch.distributed.destroy_process_group()` without a "
          "group does nothing",
          "vLLM's shutdown destroys the default process group, the trainer's own included"),
    Patch("vllm_guest_state", "vllm", "0.32", "rlhf_core.rollout.cpu_engine:cpu_engine_settings",
          "around a CPU engine's start in a process that goes on with other work: the global RNGs, torch's "
          "thread count and float32 matmul precision are put back, `torch.set_num_threads` a no-op meanwhile",
          "vLLM's engine core seeds the global RNGs and drops torch to one thread; its CPU worker sets the "
          "matmul precision: a trainer hosting the engine would train differently"),
    Patch("ray_loopback_node", "ray", "2.60", "rlhf_core.distributed.cluster:start_local_ray",
          "while a local cluster starts, `ray_constants.ENABLE_RAY_CLUSTER` is off",
          "on Linux `ray.init` turns a node address of 127.0.0.1 into the machine's reachable one, so a "
          "cluster meant for loopback would listen on every interface"),
    Patch("ray_train_fit_helpers", "ray", "2.60", "rlhf_core.distributed.cluster:StageTrainer",
          "TorchTrainer's `_create_default_callbacks` and `_initialize_and_run_controller` leave out the "
          "dataset manager without datasets and, on a cluster this process started, the placement-group "
          "cleaner and the autoscaler's resource requests",
          "each is an actor process of its own per fit that does nothing here"),
    Patch("quick_exit", "python", "3", "flows.quick_exit:arm",
          "a finished `rlhf` process ends with `os._exit` once its exit handlers have run",
          "the interpreter's teardown collects every object the model stack left: seconds per command"),
)
