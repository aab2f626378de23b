"""The on-call path stays light: the deploy-champion and rollback flows (what the alert
receiver starts) move aliases and processes, so importing them must not load the model stack."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL_STACK = ("torch", "transformers", "great_expectations", "ray", "vllm", "deepspeed")


def loaded_after_import(module: str) -> set[str]:
    # os._exit once printed: the interpreter's teardown after the model stack (2-3 s) tests nothing here
    code = f"import os, sys, json, {module}; print(json.dumps(sorted(sys.modules)), flush=True); os._exit(0)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    return {m.split(".")[0] for m in json.loads(out.stdout.splitlines()[-1])}


def test_the_deploy_and_rollback_flows_load_no_model_stack():
    assert loaded_after_import("flows.serving") & set(MODEL_STACK) == set()


def test_the_pipeline_loads_great_expectations_only_to_validate_and_peft_only_for_adapters():
    # also the control: the check sees the model stack where it is loaded. A resumed run whose
    # validation is journalled never needs Great Expectations (2 s of every start otherwise).
    # peft comes with the first LoRA adapters (`lora.with_lora`): the modules that only handle
    # weights, a rollout engine's worker among them, import `rlhf_core.models.lora` without it.
    loaded = loaded_after_import("flows.pipeline")
    assert {"torch", "transformers", "ray"} <= loaded and "great_expectations" not in loaded
    assert "peft" not in loaded
