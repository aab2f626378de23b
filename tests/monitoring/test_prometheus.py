"""The job exporter: what Prometheus scrapes, what the rank-0 sink sends, the target file."""
from __future__ import annotations

import json
import math
import pickle

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from monitoring.prometheus import FanOut, JobExporter


def scrape(exporter: JobExporter) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{exporter.url}/metrics", trust_env=False).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples, name, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def exporter(tmp_path):
    e = JobExporter("run1", "policy", targets_dir=tmp_path / "targets", kl_bound=10.0)
    yield e
    e.close()


def test_a_step_sent_through_the_pickled_sink_is_scraped_with_its_labels(exporter):
    sink = pickle.loads(pickle.dumps(exporter.sink()))  # as the rank-0 worker gets it
    sink(3, {"policy/kl": 2.5, "policy/entropy": 0.7, "policy/reward_mean": 0.4, "policy/clipfrac": 0.1,
             "policy/grad_norm": 1.5, "policy/pg_loss": -0.2, "policy/nonfinite_skipped": 1.0,
             "policy/rm_score_mean": 1.25, "policy/audit_score_mean": -0.5, "policy/ensemble_disagreement": 0.3,
             "rollout/prob_diff": 0.02, "rollout/prob_diff_bound": 0.01,
             "worker/0/host": "node-a", "worker/0/cpu_utilization": 0.93, "worker/0/samples_per_second": 120.0,
             "worker/1/host": "node-b", "worker/1/cpu_utilization": 0.41, "worker/1/step_seconds": 2.0,
             "worker/1/gpu_uuid": "GPU-5f2c", "worker/1/gpu_memory_used_bytes": 7e10, "worker/1/gpu_memory_total_bytes": 8e10,
             "timing/generate": 0.3})
    s = scrape(exporter)
    job = {"run": "run1", "stage": "policy"}
    assert value(s, "rlhf_train_step", **job) == 3
    assert value(s, "rlhf_policy_kl", **job) == 2.5 and value(s, "rlhf_policy_kl_bound", **job) == 10.0
    assert value(s, "rlhf_policy_entropy", **job) == 0.7 and value(s, "rlhf_train_loss", **job) == -0.2
    assert value(s, "rlhf_train_nonfinite_steps_total", **job) == 1.0
    assert value(s, "rlhf_policy_proxy_score", **job) == 1.25 and value(s, "rlhf_policy_audit_score", **job) == -0.5
    assert value(s, "rlhf_policy_ensemble_disagreement", **job) == 0.3
    assert value(s, "rlhf_rollout_prob_diff", **job) == 0.02 and value(s, "rlhf_rollout_prob_diff_bound", **job) == 0.01
    assert value(s, "rlhf_train_running", **job) == 1.0
    assert value(s, "rlhf_worker_cpu_utilization_ratio", **job, rank="0", host="node-a") == 0.93
    assert value(s, "rlhf_worker_cpu_utilization_ratio", **job, rank="1", host="node-b") == 0.41
    assert value(s, "rlhf_worker_samples_per_second", **job, rank="0", host="node-a") == 120.0
    assert value(s, "rlhf_worker_step_seconds", **job, rank="1", host="node-b") == 2.0
    assert value(s, "rlhf_worker_gpu_info", **job, rank="1", host="node-b", UUID="GPU-5f2c") == 1.0
    assert value(s, "rlhf_worker_gpu_memory_used_bytes", **job, rank="1", host="node-b") == 7e10
    assert not [k for k in s if k[0] == "rlhf_worker_gpu_info" and ("rank", "0") in k[1]]  # rank 0 named no GPU


def test_nan_kl_is_exported_as_nan_and_nonfinite_steps_accumulate(exporter):
    sink = exporter.sink()
    sink(1, {"policy/kl": float("nan"), "policy/nonfinite_skipped": 1.0})
    sink(2, {"policy/kl": float("nan"), "policy/nonfinite_skipped": 1.0})
    s = scrape(exporter)
    assert math.isnan(value(s, "rlhf_policy_kl", run="run1", stage="policy"))
    assert value(s, "rlhf_train_nonfinite_steps_total", run="run1", stage="policy") == 2.0


def test_the_end_of_a_job_and_a_trip_are_exported(exporter):
    exporter.finish(ok=False, trip_reason="kl_above_bound")
    s = scrape(exporter)
    assert value(s, "rlhf_train_running", run="run1", stage="policy") == 0.0
    assert value(s, "rlhf_circuit_breaker_tripped", run="run1", stage="policy", reason="kl_above_bound") == 1.0


def test_the_target_file_lists_the_endpoint_until_close(tmp_path):
    e = JobExporter("run2", "reward", targets_dir=tmp_path / "t")
    entry = json.loads(e.target_file.read_text())
    assert entry == [{"targets": [e.address], "labels": {"job_run": "run2", "job_stage": "reward"}}]
    e.close()
    assert not e.target_file.exists()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{e.url}/metrics", trust_env=False, timeout=1)


def test_ingest_needs_the_job_token_and_a_valid_body(exporter):
    url = f"{exporter.url}/ingest"
    assert httpx.post(url, json={"step": 1, "metrics": {"policy/kl": 99}}, trust_env=False).status_code == 401
    assert httpx.post(url, json={"step": 1, "metrics": {"policy/kl": 99}}, trust_env=False,
                      headers={"X-Ingest-Token": "wrong"}).status_code == 401
    assert httpx.post(url, content=b"{", trust_env=False, headers={"X-Ingest-Token": exporter.token}).status_code == 400
    assert ("rlhf_policy_kl", (("run", "run1"), ("stage", "policy"))) not in scrape(exporter)


def test_a_dead_exporter_never_breaks_training(tmp_path):
    e = JobExporter("run3", "policy")
    sink = e.sink()
    e.close()
    sink(1, {"policy/kl": 1.0})  # logged and dropped, not raised


def test_fan_out_calls_every_sink_in_order():
    calls = []
    fan = FanOut(lambda s, m: calls.append(("a", s)), None, lambda s, m: calls.append(("b", s)))
    fan(4, {})
    assert calls == [("a", 4), ("b", 4)]
