"""The feedback gateway's Prometheus side: its own counters (`Metrics`) and the thumbs per
served version, counted in the store at scrape time (`ThumbsCollector`), with the roles
(`current`, `previous`) the satisfaction alert compares (`served_versions`)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from rlhf_core.feedback.store import FeedbackStore

log = logging.getLogger(__name__)


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self):
        r = self.registry
        self.requests = Counter("rlhf_gateway_requests", "Requests answered, by route and status code",
                                ["route", "code"], registry=r)
        self.added = Histogram("rlhf_gateway_added_seconds",
                               "Time the gateway adds to a non-streamed completion (its total minus the upstream's)",
                               ["route"], registry=r,
                               buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0))
        self.feedback = Counter("rlhf_gateway_feedback", "Feedback recorded, by served version and kind "
                                "(up, down, score, choice)", ["version", "kind"], registry=r)
        self.duplicates = Counter("rlhf_gateway_feedback_duplicates", "Feedback repeated as it was: counted once",
                                  registry=r)
        self.rejected = Counter("rlhf_gateway_feedback_rejected", "Feedback refused, by reason", ["reason"],
                                registry=r)
        self.serving = Gauge("rlhf_gateway_serving_version", "1 for the registry version the gateway sends to",
                             ["version"], registry=r)


def served_versions(state_dir: Path, store: FeedbackStore | None = None) -> dict[str, str]:
    """{"current": the version serving now, "previous": the one its deploy replaced}, from the
    serving state (`current.json`, and `deployments.jsonl` of the local blue/green deploy). With
    no deploy history (a Kubernetes rollout writes none), `previous` is the version `store`
    served an answer from most recently before. A role is missing when unknown."""
    roles: dict[str, str] = {}
    try:
        roles["current"] = str(json.loads((Path(state_dir) / "current.json").read_text())["version"])
    except (FileNotFoundError, ValueError, KeyError):
        return roles
    try:
        lines = (Path(state_dir) / "deployments.jsonl").read_text().splitlines()
    except FileNotFoundError:
        if store is not None and (previous := store.version_served_before(roles["current"])) is not None:
            roles["previous"] = previous
        return roles
    for line in reversed(lines):
        event = json.loads(line)
        if event.get("event") == "deployed" and str(event["endpoint"]["version"]) == roles["current"]:
            if event.get("replaced"):
                roles["previous"] = str(event["replaced"]["version"])
            break
    return roles


class ThumbsCollector:
    """Thumbs counted in the store at scrape time, so the figures survive gateway restarts:

    - `rlhf_feedback_thumbs{version, thumb}`: up and down per served version, all time;
    - `rlhf_feedback_champion_thumbs{role, version, thumb}`: the same for the version serving
      now (`role="current"`) and the one it replaced (`role="previous"`), which the
      satisfaction alert compares.
    """

    def __init__(self, store: FeedbackStore, state_dir: Path):
        self.store, self.state_dir = store, state_dir

    def collect(self):
        family = GaugeMetricFamily("rlhf_feedback_thumbs", "Thumbs up and down per served version, all time",
                                   labels=["version", "thumb"])
        roles = GaugeMetricFamily("rlhf_feedback_champion_thumbs",
                                  "Thumbs up and down of the version serving now (role=current) and of the one "
                                  "it replaced (role=previous)", labels=["role", "version", "thumb"])
        try:
            counts = self.store.thumbs_by_version()
        except Exception:  # noqa: BLE001 - a store outage must not break /metrics
            log.exception("counting thumbs for /metrics failed")
            counts = {}
        for version, (up, down) in sorted(counts.items()):
            family.add_metric([version, "up"], up)
            family.add_metric([version, "down"], down)
        for role, version in served_versions(self.state_dir, self.store).items():
            up, down = counts.get(version, (0, 0))
            roles.add_metric([role, version, "up"], up)
            roles.add_metric([role, version, "down"], down)
        yield family
        yield roles


class CanaryCollector:
    """The running canary's call, made at scrape time from the store (`canary.decide_canary`),
    nothing while no canary runs:

    - `rlhf_canary_thumbs{arm, version, thumb}`: each arm's thumbs on answers since it started;
    - `rlhf_canary_difference{bound}`: canary minus champion thumbs-up rate (`estimate`) and its
      always-valid interval (`low`, `high`); NaN before `min_ratings`;
    - `rlhf_canary_decision{action, version}`: 1 for the call now (promote | roll_back |
      continue), which the `CanaryWorse` alert and `rlhf canary decide` act on.
    """

    def __init__(self, store: FeedbackStore, upstream, cfg):
        self.store, self.upstream, self.cfg = store, upstream, cfg

    def collect(self):
        from rlhf_core.serving.canary import canary_arms, decide_canary  # noqa: PLC0415 - imports the config

        if (canary := self.upstream.canary()) is None:
            return
        try:
            champion, mine = canary_arms(self.store, canary)
            decision = decide_canary(self.store, canary, self.cfg)
        except Exception:  # noqa: BLE001 - a store outage must not break /metrics
            log.exception("deciding the canary for /metrics failed")
            return
        thumbs = GaugeMetricFamily("rlhf_canary_thumbs", "Thumbs of the canary and of the champion since the canary "
                                   "started", labels=["arm", "version", "thumb"])
        for arm, version, counts in (("champion", canary.champion_version, champion),
                                     ("canary", canary.endpoint.version, mine)):
            thumbs.add_metric([arm, version, "up"], counts.up)
            thumbs.add_metric([arm, version, "down"], counts.n - counts.up)
        difference = GaugeMetricFamily("rlhf_canary_difference", "Canary minus champion thumbs-up rate, with its "
                                       "always-valid interval", labels=["bound"])
        for bound, value in (("estimate", decision.difference), ("low", decision.low), ("high", decision.high)):
            difference.add_metric([bound], value)
        calls = GaugeMetricFamily("rlhf_canary_decision", "1 for the canary's call now", labels=["action", "version"])
        for action in ("promote", "roll_back", "continue"):
            calls.add_metric([action, canary.endpoint.version], float(decision.action == action))
        yield from (thumbs, difference, calls)
