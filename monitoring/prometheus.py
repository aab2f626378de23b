"""Prometheus export of training metrics: one endpoint per training job.

The process that drives a job (the Prefect task calling `trainer.fit()`) runs a
`JobExporter`: a small HTTP server with

- `GET /metrics`: the job's series in Prometheus' text format, for Prometheus to scrape;
- `POST /ingest`: where the job's rank-0 worker sends each step's flat metrics (through the
  picklable `PrometheusSink`), with a per-job token. Rank 0 already gathers every worker's
  figures each step, so one endpoint carries all workers, on any number of nodes: workers
  on other nodes reach the driver as they reach Ray's head.

Prometheus finds the endpoint through a file-based target list: the exporter writes
`<targets_dir>/<stage>-<run>.json` (`file_sd_configs`) while the job runs and removes it
when the exporter closes. On failure it stays up `linger_s` more seconds, so that the final
state (`rlhf_train_running 0`, `rlhf_circuit_breaker_tripped 1`) is scraped and alerts can fire.

Series (labels `run`, `stage`; per-worker ones also `rank`, `host`), named in
`infra/prometheus/rules/rlhf.rules.yml`'s terms:

    rlhf_train_step, rlhf_train_last_step_timestamp_seconds, rlhf_train_running,
    rlhf_train_loss, rlhf_train_grad_norm, rlhf_train_nonfinite_steps_total,
    rlhf_policy_kl, rlhf_policy_kl_bound, rlhf_policy_entropy, rlhf_policy_reward_mean,
    rlhf_policy_clip_fraction, rlhf_policy_proxy_score, rlhf_policy_audit_score,
    rlhf_policy_ensemble_disagreement, rlhf_rollout_prob_diff, rlhf_rollout_prob_diff_bound,
    rlhf_circuit_breaker_tripped{reason},
    rlhf_worker_cpu_utilization_ratio, rlhf_worker_step_seconds,
    rlhf_worker_samples_per_second, rlhf_rollout_tokens_per_second, rlhf_rollout_sync_seconds,
    rlhf_worker_gpu_utilization_ratio, rlhf_worker_gpu_memory_used_bytes,
    rlhf_worker_gpu_memory_total_bytes, rlhf_worker_gpu_max_allocated_bytes,
    rlhf_worker_gpu_info{UUID} (GPU workers only)

Per-worker figures arrive as flat keys `worker/<rank>/<figure>` with `worker/<rank>/host`
(a string) naming the node.
"""
from __future__ import annotations

import hmac
import json
import logging
import math
import os
import re
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)

STEP_GAUGES = {  # flat metric -> gauge (labels run, stage)
    "policy/kl": "rlhf_policy_kl",
    "policy/entropy": "rlhf_policy_entropy",
    "policy/reward_mean": "rlhf_policy_reward_mean",
    "policy/clipfrac": "rlhf_policy_clip_fraction",
    "policy/rm_score_mean": "rlhf_policy_proxy_score",
    "policy/audit_score_mean": "rlhf_policy_audit_score",
    "policy/ensemble_disagreement": "rlhf_policy_ensemble_disagreement",
    "rollout/prob_diff": "rlhf_rollout_prob_diff",
    "rollout/prob_diff_bound": "rlhf_rollout_prob_diff_bound",
    "rollout/tokens_per_s": "rlhf_rollout_tokens_per_second",
    "rollout/sync_s": "rlhf_rollout_sync_seconds",
    "policy/grad_norm": "rlhf_train_grad_norm",
    "policy/pg_loss": "rlhf_train_loss",
    "reward/grad_norm": "rlhf_train_grad_norm",
    "reward/loss": "rlhf_train_loss",
}
NONFINITE_KEYS = ("policy/nonfinite_skipped", "policy/critic_nonfinite_skipped", "reward/nonfinite_skipped")
WORKER_GAUGES = {  # worker/<rank>/<figure> -> gauge (labels run, stage, rank, host)
    "cpu_utilization": "rlhf_worker_cpu_utilization_ratio",
    "step_seconds": "rlhf_worker_step_seconds",
    "samples_per_second": "rlhf_worker_samples_per_second",
    "gpu_utilization": "rlhf_worker_gpu_utilization_ratio",
    "gpu_memory_used_bytes": "rlhf_worker_gpu_memory_used_bytes",
    "gpu_memory_total_bytes": "rlhf_worker_gpu_memory_total_bytes",
    "gpu_max_allocated_bytes": "rlhf_worker_gpu_max_allocated_bytes",
}
_WORKER_KEY = re.compile(r"^worker/(\d+)/(\w+)$")
SHUTDOWN_POLL_S = 0.05  # how often the serving loop looks for a shutdown: what closing an exporter waits
_HELP = {
    "rlhf_policy_kl": "Mean per-sequence KL to the reference policy at the last step",
    "rlhf_policy_entropy": "Mean token entropy of the last step's rollouts (nats)",
    "rlhf_policy_reward_mean": "Mean sequence reward of the last step's rollouts",
    "rlhf_policy_clip_fraction": "Share of tokens whose ratio was clipped at the last step",
    "rlhf_policy_proxy_score": "Mean normalised score of the last step's rollouts by the reward model the policy trains on",
    "rlhf_policy_audit_score": "Mean normalised score of the last step's rollouts by the held-out audit reward model",
    "rlhf_policy_ensemble_disagreement": "Mean over the last step's rollouts of the std across the reward-model ensemble",
    "rlhf_rollout_prob_diff": "Mean |p_engine - p_trainer| of the last step's sampled tokens (weight-sync health)",
    "rlhf_rollout_prob_diff_bound": "The circuit breaker's bound on rlhf_rollout_prob_diff for the trainer's precision",
    "rlhf_train_grad_norm": "Global gradient norm at the last optimizer step",
    "rlhf_train_loss": "Training loss at the last step",
    "rlhf_worker_cpu_utilization_ratio": "Worker process CPU time / wall time over its last step",
    "rlhf_worker_step_seconds": "Wall time of the worker's last step",
    "rlhf_worker_samples_per_second": "Samples the worker processed per second over its last step",
    "rlhf_worker_gpu_utilization_ratio": "Mean GPU utilisation of the worker's device over its last step (NVML)",
    "rlhf_worker_gpu_memory_used_bytes": "Largest memory in use on the worker's GPU during its last step, every process's (NVML)",
    "rlhf_worker_gpu_memory_total_bytes": "Memory of the worker's GPU (NVML)",
    "rlhf_worker_gpu_max_allocated_bytes": "torch's largest allocation in the worker process during its last step",
    "rlhf_rollout_tokens_per_second": "Tokens the rollout engine generated per second at the last step",
    "rlhf_rollout_sync_seconds": "Seconds the last step's weight sync into the rollout engine took",
}


class JobExporter:
    """The Prometheus endpoint of one training job (see the module docstring)."""

    def __init__(self, run: str, stage: str, *, host: str = "127.0.0.1", port: int = 0,
                 advertise_host: str | None = None, targets_dir: Path | None = None, kl_bound: float | None = None,
                 on_record=None):
        self.run, self.stage = run, stage
        self.on_record = on_record  # also told each ingested step, in this process (e.g. a progress bar)
        self.advertise_host = advertise_host
        self.targets_dir = None if targets_dir is None else Path(targets_dir)
        self.token = secrets.token_urlsafe(24)
        self.registry = CollectorRegistry()
        labels = ["run", "stage"]
        self._gauges = {name: Gauge(name, _HELP[name], labels, registry=self.registry)
                        for name in set(STEP_GAUGES.values())}
        self._workers = {name: Gauge(name, _HELP[name], [*labels, "rank", "host"], registry=self.registry)
                         for name in WORKER_GAUGES.values()}
        self._step = Gauge("rlhf_train_step", "Last completed training step", labels, registry=self.registry)
        self._last = Gauge("rlhf_train_last_step_timestamp_seconds", "Unix time of the last completed step",
                           labels, registry=self.registry)
        self._running = Gauge("rlhf_train_running", "1 while the job runs, 0 once it ended", labels,
                              registry=self.registry)
        self._nonfinite = Counter("rlhf_train_nonfinite_steps", "Optimizer steps skipped for NaN/Inf loss or gradients",
                                  labels, registry=self.registry)
        self._tripped = Gauge("rlhf_circuit_breaker_tripped", "1 when the circuit breaker stopped the job",
                              [*labels, "reason"], registry=self.registry)
        self._gpu_info = Gauge("rlhf_worker_gpu_info", "1 for the GPU (its NVML UUID, DCGM's label) each rank computes on",
                               [*labels, "rank", "host", "UUID"], registry=self.registry)
        self._kl_bound = Gauge("rlhf_policy_kl_bound", "The KL bound of the job (policy.kl_bound)", labels,
                               registry=self.registry)
        self._lock = threading.Lock()
        self.workers: dict[str, dict[str, str]] = {}  # rank -> {"host", "node", "pid"}: where each runs
        if kl_bound is not None:
            self._kl_bound.labels(run, stage).set(kl_bound)
        self._running.labels(run, stage).set(1)
        self._nonfinite.labels(run, stage)  # exported as 0 from the start: increase() needs a baseline
        self._server = ThreadingHTTPServer((host, port), _handler(self))
        # close() waits for the serving loop to see the shutdown: at most one poll interval (0.5 s by default)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_S},
                                        name=f"metrics-{stage}", daemon=True)
        self._thread.start()
        self._write_target()

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{self.advertise_host or host}:{port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def sink(self) -> "PrometheusSink":
        return PrometheusSink(f"{self.url}/ingest", self.token)

    @property
    def target_file(self) -> Path | None:
        return None if self.targets_dir is None else self.targets_dir / f"{self.stage}-{self.run}.json"

    def _write_target(self) -> None:
        if self.target_file is None:
            return
        self.targets_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.target_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps([{"targets": [self.address], "labels": {"job_run": self.run, "job_stage": self.stage}}]))
        os.replace(tmp, self.target_file)  # Prometheus never reads half a file

    def record(self, step: int, metrics: dict) -> None:
        """Update the series from one step's flat metrics (unknown keys are ignored)."""
        run, stage = self.run, self.stage
        with self._lock:
            self._step.labels(run, stage).set(step)
            self._last.labels(run, stage).set(time.time())
            for key, name in STEP_GAUGES.items():
                if _number(metrics.get(key)):
                    self._gauges[name].labels(run, stage).set(float(metrics[key]))
            skipped = sum(float(metrics[k]) for k in NONFINITE_KEYS if _number(metrics.get(k)))
            if skipped > 0 and math.isfinite(skipped):
                self._nonfinite.labels(run, stage).inc(skipped)
            for key, value in metrics.items():
                m = _WORKER_KEY.match(key)
                if m and m.group(2) in ("host", "node", "pid"):
                    self.workers.setdefault(m.group(1), {})[m.group(2)] = str(value)
                if m and m.group(2) == "gpu_uuid":  # which GPU the rank computes on: joins DCGM's series
                    host = str(metrics.get(f"worker/{m.group(1)}/host", "unknown"))
                    self._gpu_info.labels(run, stage, m.group(1), host, str(value)).set(1)
                if m and m.group(2) in WORKER_GAUGES and _number(value):
                    rank = m.group(1)
                    host = str(metrics.get(f"worker/{rank}/host", "unknown"))
                    self._workers[WORKER_GAUGES[m.group(2)]].labels(run, stage, rank, host).set(float(value))
        if self.on_record is not None:
            self.on_record(step, metrics)

    def metrics_text(self) -> bytes:
        with self._lock:
            return generate_latest(self.registry)

    def finish(self, ok: bool, trip_reason: str | None = None) -> None:
        """The job ended: `rlhf_train_running` 0, and the breaker's reason if it tripped."""
        with self._lock:
            self._running.labels(self.run, self.stage).set(0)
            if trip_reason is not None:
                self._tripped.labels(self.run, self.stage, trip_reason).set(1)

    def close(self, linger_s: float = 0.0) -> None:
        """Keep serving `linger_s` seconds (so the end is scraped), then stop and drop the target."""
        if linger_s > 0:
            time.sleep(linger_s)
        if self.target_file is not None:
            self.target_file.unlink(missing_ok=True)
        self._server.shutdown()
        self._server.server_close()


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _handler(exporter: JobExporter):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path.split("?")[0] != "/metrics":
                return self._send(404, b"not found\n", "text/plain")
            self._send(200, exporter.metrics_text(), CONTENT_TYPE_LATEST)

        def do_POST(self):  # noqa: N802
            if self.path != "/ingest":
                return self._send(404, b"not found\n", "text/plain")
            if not hmac.compare_digest(self.headers.get("X-Ingest-Token", ""), exporter.token):
                return self._send(401, b"bad ingest token\n", "text/plain")
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                exporter.record(int(body["step"]), dict(body["metrics"]))
            except (ValueError, KeyError, TypeError) as exc:
                return self._send(400, f"bad ingest payload: {exc}\n".encode(), "text/plain")
            self._send(204, b"", "text/plain")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes every few seconds: not worth a log line
            pass

    return Handler


class PrometheusSink:
    """`MetricsCallback` that sends each step's metrics to a `JobExporter`. Picklable, so the
    rank-0 worker calls it directly. Best effort: a monitoring hiccup must never stop
    training, so failures are logged (once per minute at most) and dropped."""

    def __init__(self, ingest_url: str, token: str):
        self.ingest_url, self.token = ingest_url, token
        self._client: httpx.Client | None = None
        self._last_warning = 0.0

    def __getstate__(self) -> dict:
        return {"ingest_url": self.ingest_url, "token": self.token, "_client": None, "_last_warning": 0.0}

    def __call__(self, step: int, metrics: dict) -> None:
        if self._client is None:
            self._client = httpx.Client(timeout=2.0, trust_env=False)
        clean = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
        body = json.dumps({"step": step, "metrics": clean})  # NaN stays NaN: a diverged KL must show
        try:
            self._client.post(self.ingest_url, content=body, headers={
                "X-Ingest-Token": self.token, "Content-Type": "application/json"}).raise_for_status()
        except httpx.HTTPError as exc:
            if time.monotonic() - self._last_warning > 60:
                self._last_warning = time.monotonic()
                log.warning("metrics export to %s failed: %s", self.ingest_url, exc)


class FanOut:
    """One `MetricsCallback` calling several (MLflow and Prometheus); picklable if they are."""

    def __init__(self, *sinks):
        self.sinks = [s for s in sinks if s is not None]

    def __call__(self, step: int, metrics: dict) -> None:
        for sink in self.sinks:
            sink(step, metrics)
