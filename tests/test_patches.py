"""The patches to other libraries (`rlhf_core.patches`): each still needed, each where it says.

A test per patch checks the upstream behaviour it works around; when an upgrade changes that
behaviour the test fails, and the patch (and its test) can go or must be rewritten."""
from __future__ import annotations

import importlib
import inspect
import platform
import subprocess
import sys

import pytest

from rlhf_core.patches import PATCHES


def installed_version(library: str) -> str:
    return platform.python_version() if library == "python" else importlib.import_module(library).__version__


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_each_patch_targets_the_installed_version_and_names_where_it_is_applied(patch):
    installed = installed_version(patch.library)
    assert installed == patch.version or installed.startswith(f"{patch.version}."), (
        f"{patch.library} {installed} is installed; the patch {patch.name} was written for {patch.version}: "
        f"check whether its upstream behaviour changed (tests/test_patches.py) and update or remove it")
    module, _, name = patch.applied_by.partition(":")
    assert callable(getattr(importlib.import_module(module), name))


def test_the_list_has_one_test_per_patch():
    tested = {name.removeprefix("test_upstream_") for name in globals() if name.startswith("test_upstream_")}
    assert tested == {p.name for p in PATCHES}


def source(module: str) -> str:
    return inspect.getsource(importlib.import_module(module))


def test_upstream_deepspeed_without_mlflow():
    # the autotuner, which DeepSpeed imports at start-up, imports MLflow when it can
    assert "import mlflow" in source("deepspeed.autotuning.autotuner")


def test_upstream_muon_uncompiled():
    # ZeRO imports the Muon module to ask whether the optimizer is Muon; the module compiles its kernels
    assert "muon_optimizer import MuonWithAuxAdam" in source("deepspeed.runtime.zero.stage_1_and_2")
    assert "@compiler.compile()" in source("deepspeed.runtime.zero.muon.original_muon")


def test_upstream_vllm_rendezvous_dir():
    from vllm.v1.executor import multiproc_executor, uniproc_executor

    for module in (multiproc_executor, uniproc_executor):  # the name each executor calls at start
        assert "get_file_store_init_method()" in inspect.getsource(module)
        assert hasattr(module, "get_file_store_init_method")


def test_upstream_vllm_keeps_host_group():
    from vllm.distributed import parallel_state

    assert "torch.distributed.destroy_process_group()" in inspect.getsource(parallel_state)


def test_upstream_vllm_guest_state():
    # the CPU worker replaces torch.set_num_threads after binding its threads
    assert "torch.set_num_threads = skip_set_num_threads" in source("vllm.v1.worker.cpu_worker")
    assert "set_float32_matmul_precision" in source("vllm.v1.worker.gpu_worker")


def test_upstream_ray_loopback_node():
    from ray._private import ray_constants, services

    assert hasattr(ray_constants, "ENABLE_RAY_CLUSTER")
    assert "ray_constants.ENABLE_RAY_CLUSTER" in inspect.getsource(services)


def test_upstream_ray_train_fit_helpers():
    # the behaviour itself is checked on a cluster in tests/rlhf_core/distributed/test_cluster.py
    from ray.train.torch import TorchTrainer

    assert hasattr(TorchTrainer, "_create_default_callbacks") and hasattr(TorchTrainer, "_initialize_and_run_controller")


def test_upstream_quick_exit():
    # it relies on exit handlers running last-registered first, so those registered after arm() run
    # before it ends the process; what it saves is measured by bench/exit_time.py, what it keeps is
    # tested in tests/flows/test_quick_exit.py
    code = "import atexit; atexit.register(print, 'first'); atexit.register(print, 'second')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["second", "first"]
