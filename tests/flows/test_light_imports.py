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


PIPELINE_THEN_ROC_CURVE = """
import json, os, sys
import flows.pipeline
loaded = sorted(sys.modules)
import transformers.generation.candidate_generator as cg
fpr, tpr, thresholds = cg.roc_curve([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8])
print(json.dumps({"loaded": loaded, "available": cg.is_sklearn_available(), "after": "sklearn.metrics" in sys.modules,
                  "roc": [fpr.tolist(), tpr.tolist(), thresholds[1:].tolist()]}), flush=True)
os._exit(0)
"""


@pytest.fixture(scope="module")
def pipeline_process() -> dict:
    """One process that imports the pipeline and lists what it loaded, then calls the one
    scikit-learn function transformers' assisted decoding uses (the module's two tests share it)."""
    return printed_json(PIPELINE_THEN_ROC_CURVE)


def test_the_pipeline_loads_great_expectations_only_to_validate_and_peft_only_for_adapters(pipeline_process):
    # also the control: the check sees the model stack where it is loaded. A resumed run whose
    # validation is journalled never needs Great Expectations (2 s of every start otherwise).
    # peft comes with the first LoRA adapters (`lora.with_lora`): the modules that only handle
    # weights, a rollout engine's worker among them, import `rlhf_core.models.lora` without it.
    loaded = {m.split(".")[0] for m in pipeline_process["loaded"]}
    assert {"torch", "transformers", "ray"} <= loaded and "great_expectations" not in loaded
    assert "peft" not in loaded
    # scikit-learn, which transformers imports with every model class and the pipeline never
    # calls, waits for its first use (rlhf_core.lazy_imports), though the module that uses it is loaded
    assert "sklearn" not in loaded and "transformers.generation.candidate_generator" in pipeline_process["loaded"]


def test_assisted_decoding_still_gets_scikit_learns_roc_curve_on_its_first_call(pipeline_process):
    # transformers' assisted decoding is the one caller of what rlhf_core.lazy_imports defers:
    # it still sees scikit-learn as installed, and the curve is scikit-learn's own (its
    # documentation's example), imported by that call
    assert pipeline_process["available"] and pipeline_process["after"]
    fpr, tpr, thresholds = pipeline_process["roc"]
    assert fpr == [0.0, 0.0, 0.5, 0.5, 1.0] and tpr == [0.0, 0.5, 0.5, 1.0, 1.0]
    assert thresholds == [0.8, 0.4, 0.35, 0.1]
