"""The `collect-feedback` flow: ratings on served answers become a preference dataset.

Scheduled before the nightly run (`prefect.yaml`), it exports the feedback the gateway stored
since the last export as a versioned, fingerprinted dataset under `feedback.export_dir`,
logged to MLflow with the served versions it came from; with `feedback.use` the next
pipeline run trains on it beside the base preference data.
"""
from __future__ import annotations

from typing import Any

from prefect import flow

from rlhf_core.config import load_config
from rlhf_core.config.default import DEFAULT_CONFIG
from tasks.feedback import collect_feedback


@flow(name="collect-feedback", log_prints=True)
def collect_feedback_flow(config_path: str = DEFAULT_CONFIG, overrides: list[str] | None = None) -> dict[str, Any]:
    """Export the feedback since the last export.

    Args:
        config_path: pipeline config; its `feedback` section says where the store and exports are.
        overrides: `key.path=value` items applied on top of the file.
    """
    cfg = load_config(config_path, overrides)
    return collect_feedback(cfg).summary()
