"""The Ray cluster the training stages share: the pipeline flow opens it around them, so the
reward and policy stages start their workers on one cluster instead of one each."""
from __future__ import annotations

from rlhf_core.distributed.cluster import ray_session as training_cluster

__all__ = ["training_cluster"]
