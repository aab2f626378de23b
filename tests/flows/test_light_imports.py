"""The on-call path stays light: the deploy-champion and rollback flows (what the alert
receiver starts) move aliases and processes, so importing them must not load the model stack."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL_STACK = ("torch", "transformers", "great_expectations", "ray", "vllm", "deepspeed")


def printed_json(code: str):
    """What `code`, run in a fresh interpreter from the checkout, printed last as JSON."""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    return json.loads(out.stdout.splitlines()[-1])


def loaded_after_import(module: str) -> set[str]:
    # os._exit once printed: the interpreter's teardown after the model stack (2-3 s) tests nothing here
    code = f"import os, sys, json, {module}; print(json.dumps(sorted(sys.modules)), flush=True); os._exit(0)"
    return {m.split(".")[0] for m in printed_json(code)}


def test_the_deploy_and_rollback_flows_load_no_model_stack():
    assert loaded_after_import("flows.serving") & set(MODEL_STACK) == set()


@pytest.fixture(scope="module")
def pipeline_process() -> dict:
    """What a process that imports the pipeline loaded, and what `import rlhf_core` changed."""
    return printed_json("import json, os, sys\nhooks = len(sys.meta_path)\nimport rlhf_core\nhooks_after = len(sys.meta_path)\n"
                        "import flows.pipeline\n"
                        "print(json.dumps({'loaded': sorted(sys.modules), 'hooks': [hooks, hooks_after]}), flush=True)\n"
                        "os._exit(0)")


def test_the_pipeline_loads_great_expectations_only_to_validate_and_peft_only_for_adapters(pipeline_process):
    # also the control: the check sees the model stack where it is loaded. A resumed run whose
    # validation is journalled never needs Great Expectations (2 s of every start otherwise).
    # peft comes with the first LoRA adapters (`lora.with_lora`): the modules that only handle
    # weights, a rollout engine's worker among them, import `rlhf_core.models.lora` without it.
    loaded = {m.split(".")[0] for m in pipeline_process["loaded"]}
    assert {"torch", "transformers", "ray"} <= loaded and "great_expectations" not in loaded
    assert "peft" not in loaded


def test_importing_the_library_installs_no_import_hook(pipeline_process):
    hooks, hooks_after = pipeline_process["hooks"]
    assert hooks_after == hooks
