"""Prefect task of the `collect-feedback` flow: the feedback since the last export becomes a
versioned, fingerprinted preference dataset, logged to MLflow with its lineage.

An export directory `<feedback.export_dir>/<version>/` holds

    preferences.jsonl   pairs (prompt, chosen, rejected; plus source, response_id, model_version)
    ratings.jsonl       unpaired examples (prompt, completion, label, score, response_id, model_version)
    manifest.json       version, fingerprint, the time window, the served versions it came from,
                        what was dropped and why, the capped users, the feedback's measured biases
                        and agreement (`quality`) and the same in a few lines (`report`)

It is written to a temporary directory and renamed into place: a reader sees all of it or
none. The store records the export last, so a crash before that re-exports the same window
under a new version the next time (the fingerprint shows it is the same feedback).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import mlflow
import pandas as pd
from mlflow.entities import DatasetInput, InputTag
from prefect import get_run_logger, task

from rlhf_core.config import PipelineConfig
from rlhf_core.data.schema import write_jsonl
from rlhf_core.feedback.export import FeedbackDataset, build_dataset, text_view
from rlhf_core.feedback.store import FeedbackStore
from rlhf_core.serving.gateway import store_url
from rlhf_core.training.preference_rounds import contract_filter
from tasks.tracking import _experiment_id, git_commit, tracking_client

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class FeedbackExport:
    status: str  # exported | nothing_new
    version: str | None = None
    path: str | None = None
    fingerprint: str | None = None
    pairs: int = 0
    ratings: int = 0
    dropped: dict | None = None
    served_versions: dict | None = None
    run_id: str | None = None

    def summary(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def export_root(cfg: PipelineConfig) -> Path:
    return Path(cfg.feedback.export_dir or Path(cfg.output_dir) / "feedback").resolve()


def rolled_back_versions(client, name: str) -> set[str]:
    """Versions of the registered policy `name` that a rollback moved `champion` away from (tag
    `rolled_back_by_incident`)."""
    try:
        versions = client.search_model_versions(f"name='{name}'")
    except mlflow.exceptions.MlflowException:
        return set()
    return {str(v.version) for v in versions if "rolled_back_by_incident" in (v.tags or {})}


def _contract(ds: FeedbackDataset, cfg: PipelineConfig) -> FeedbackDataset:
    """Pairs whose text the preference-data contract names are dropped (`data_contract`)."""
    views = [text_view(p) for p in ds.pairs]
    kept, dropped = contract_filter(views, cfg.validation)  # returns the views it kept, themselves
    if dropped:
        kept_ids = {id(v) for v in kept}
        ds.pairs = [p for p, v in zip(ds.pairs, views) if id(v) in kept_ids]
        ds.dropped["data_contract"] = dropped
    return ds


def _write(ds: FeedbackDataset, manifest: dict, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        write_jsonl(ds.pairs, tmp / "preferences.jsonl")
        write_jsonl(ds.ratings, tmp / "ratings.jsonl")
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        os.chmod(tmp, 0o755)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _log(cfg: PipelineConfig, ds: FeedbackDataset, manifest: dict, dest: Path) -> str:
    client = tracking_client(cfg)
    exp_id = _experiment_id(client, cfg.tracking.experiment)
    versions = ",".join(ds.versions)
    run = client.create_run(exp_id, run_name=manifest["version"], tags={
        "pipeline": "collect-feedback", "git.commit": git_commit(), "feedback.version": manifest["version"],
        "feedback.fingerprint": manifest["fingerprint"], "feedback.served_versions": versions})
    rid = run.info.run_id
    client.log_metric(rid, "feedback/pairs", len(ds.pairs))
    client.log_metric(rid, "feedback/ratings", len(ds.ratings))
    client.log_metric(rid, "feedback/users", ds.users)
    for reason, n in ds.dropped.items():
        client.log_metric(rid, f"feedback/dropped_{reason}", n)
    if ds.pairs:
        frame = pd.DataFrame([text_view(p) | {"model_version": p["model_version"]} for p in ds.pairs])
        dataset = mlflow.data.from_pandas(frame, source=str(dest / "preferences.jsonl"), name=manifest["version"],
                                          digest=manifest["fingerprint"][:32])
        client.log_inputs(rid, [DatasetInput(dataset._to_mlflow_entity(), [InputTag("mlflow.data.context", "training")])])
    client.log_artifacts(rid, str(dest), "feedback")
    client.set_terminated(rid, "FINISHED")
    return rid


@task(name="collect-feedback")
def collect_feedback(cfg: PipelineConfig) -> FeedbackExport:
    """Export the feedback written since the last export (up to `feedback.settle_s` ago)."""
    logger = get_run_logger()
    store = FeedbackStore(store_url(cfg))
    try:
        last = store.last_export()
        after, until = (last["covered_until"] if last else 0.0), time.time() - cfg.feedback.settle_s
        ratings, choices = store.feedback_between(after, until)
        if not ratings and not choices:
            logger.info("no new feedback since %s", last["version"] if last else "the start")
            return FeedbackExport("nothing_new")
        f = cfg.feedback
        ds = build_dataset(ratings, choices, rolled_back=rolled_back_versions(tracking_client(cfg), cfg.tracking.registered_model),
                           max_user_share=f.max_user_share, min_user_flood=f.min_user_flood,
                           max_burst=f.max_burst, burst_window_s=f.burst_window_s)
        ds = _contract(ds, cfg)
        version = "feedback-" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        manifest = {"version": version, "fingerprint": ds.fingerprint(), "created_at": time.time(),
                    "window": {"after": after, "until": until}, "pairs": len(ds.pairs), "ratings": len(ds.ratings),
                    "users": ds.users, "served_versions": ds.versions, "dropped": ds.dropped,
                    "capped_users": ds.capped_users, "quality": ds.quality, "report": ds.report(),
                    "store": store.engine.url.render_as_string(hide_password=True)}
        dest = export_root(cfg) / version
        _write(ds, manifest, dest)
        run_id = _log(cfg, ds, manifest, dest)
        store.record_export(covered_until=until, version=version, fingerprint=manifest["fingerprint"], path=str(dest))
        for line in ds.report():
            logger.info("%s: %s", version, line)
        logger.info("exported %s: %d pairs, %d ratings from versions %s", version, len(ds.pairs), len(ds.ratings),
                    ds.versions)
        return FeedbackExport("exported", version, str(dest), manifest["fingerprint"], len(ds.pairs), len(ds.ratings),
                              ds.dropped, ds.versions, run_id)
    finally:
        store.close()
