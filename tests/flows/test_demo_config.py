"""The shipped demo config's bars: a base policy that did not learn stops the run at SFT."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.pipeline import rlhf_pipeline
from rlhf_core.config import load_config
from tasks.summary import PipelineFailed

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"


def test_the_demo_sets_bars_that_fail_each_stage_where_its_cause_is():
    cfg = load_config(DEMO)
    # A base policy that never learned the digit-wise sum answers 0-5% of the held-out sums;
    # one that did answers the carry-free ones, about 30%: the bar sits between.
    assert 0.1 <= cfg.sft.min_eval_accuracy <= 0.25
    assert cfg.reward.min_eval_accuracy > 0.5
    assert cfg.policy.min_accuracy_gain > 0


@pytest.mark.slow
def test_a_base_policy_that_did_not_learn_stops_the_demo_at_sft(prefect_server, tmp_path):
    bar = load_config(DEMO).sft.min_eval_accuracy
    overrides = [
        # 32 optimizer steps: far too few to learn addition, on any machine and seed
        "sft.epochs=1", "sft.batch_size=256",
        f"output_dir={tmp_path / 'runs'}", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
    ]
    with pytest.raises(PipelineFailed) as exc:
        rlhf_pipeline(config_path=str(DEMO), overrides=overrides)
    summary = exc.value.summary
    assert summary["failed_stage"] == "sft"
    match = re.fullmatch(r"sft: held-out accuracy (\d\.\d{3}) is below sft\.min_eval_accuracy=([\d.]+)", summary["error"])
    assert match, summary["error"]
    assert float(match[1]) < bar and float(match[2]) == bar
    assert set(summary["stages"]) == {"data", "validate", "sft"}  # the reward and policy stages never started
    client = MlflowClient(summary["mlflow_tracking_uri"])
    assert client.get_run(summary["mlflow_run_id"]).info.status == "FAILED"


def test_the_tiny_test_config_given_as_overrides_to_the_demo_config_is_itself(tmp_path, tiny_config_factory):
    """The deployment tests start the demo config made small by overrides; any key the demo
    sets and the test config does not would leak the demo's value (and its bars) into them."""
    from rlhf_core.config import parse_config

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in d.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
        return out

    raw = tiny_config_factory(tmp_path)
    overrides = [f"{key}={json.dumps(value)}" for key, value in flat(raw).items()]
    as_overrides = flat(load_config(DEMO, overrides).model_dump(mode="json"))
    alone = flat(parse_config(raw).model_dump(mode="json"))
    # the deployment test sets these two itself
    differ = {k for k in alone if as_overrides[k] != alone[k]} - {"gates.auto_promote", "serving.smoke_prompt"}
    assert differ == set()
