"""A canary: a candidate served beside the champion to a share of the users, until their ratings
decide whether it replaces the champion.

State, beside `current.json` (the champion) in the serving directory: `canary.json`, the
canary's `Endpoint`, the share of users it serves, the champion it is compared with and when it
started. `rlhf_core.serving.server.deploy(..., canary_share=...)` starts one on the port the
champion does not use, after the same health and smoke checks as a blue/green deploy and a
check that the machine has the memory for a second server; no other deploy starts while it runs.

- Routing (`routed_to_canary`): the gateway sends a user to the canary when a hash of the
  canary's version and the user's hashed id falls below the share: the same user always gets
  the same version for the canary's life, and each canary draws its own users.
- The decision (`decide_canary`): thumbs-up rates of both versions on the answers given since
  the canary started, compared by the always-valid test of `rlhf_core.eval.always_valid`
  (looked at as often as wanted), with `serving.canary`'s margin, error rate, minimum and
  maximum of ratings, and a maximum duration after which a call still open keeps the champion;
  and counter-metrics on its answers (`canary_guards`: refusals, giving in to pushback, length)
  that roll it back whatever its thumbs say.
- Ending it (`finish_canary`): `promote` makes the canary `current.json` and drains the old
  champion; `roll_back` removes `canary.json` (every user goes to the champion from then on)
  and drains the canary. Either way one version serves after, and a request either server had
  accepted is answered before it stops (`rlhf_core.serving.drain`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.config import CanaryConfig, ServingConfig
from rlhf_core.eval.always_valid import Arm, Decision, decide
from rlhf_core.models.memory import MachineMemory, gib
from rlhf_core.serving.canary_guards import guards
from rlhf_core.serving.errors import ServingError
from rlhf_core.serving.state import Endpoint, append_history, deploy_lock, recorded_endpoint, write_json_atomic

CANARY = "canary.json"
GiB = 1 << 30
# vLLM's CPU server process without its weights and KV cache: the demo's server (1 MB of weights,
# a 0.5 GiB cache) holds about 1 GiB (docs/operations.md, "Canary").
SERVER_RUNTIME_BYTES = GiB // 2


@dataclass(frozen=True)
class Canary:
    endpoint: Endpoint
    share: float  # of the users it serves
    champion_version: str  # the version it is compared with
    started_at: float  # Unix time: only answers given since count

    def to_dict(self) -> dict:
        return {"endpoint": self.endpoint.to_dict(), "share": self.share, "champion_version": self.champion_version,
                "started_at": self.started_at}

    def summary(self) -> dict:
        return {"status": "canary", "version": self.endpoint.version, "champion": self.champion_version,
                "share": self.share, "endpoint": self.endpoint.url}

    @classmethod
    def from_dict(cls, d: dict) -> "Canary":
        return cls(Endpoint.from_dict(d["endpoint"]), float(d["share"]), str(d["champion_version"]),
                   float(d["started_at"]))


def read_canary(state_dir: Path) -> Canary | None:
    try:
        return Canary.from_dict(json.loads((Path(state_dir) / CANARY).read_text()))
    except FileNotFoundError:
        return None


def routed_to_canary(user_hash: str, canary_version: str, share: float) -> bool:
    """Whether this user is served by the canary: sticky for the canary's life (`share` of users)."""
    digest = hashlib.sha256(f"canary:{canary_version}:{user_hash}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def server_bytes(model_dir: Path, cfg: ServingConfig) -> int:
    """Memory a server of `model_dir` takes: its weights, its KV cache and vLLM's process."""
    weights = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
    return weights + int(cfg.kv_cache_gib * GiB) + SERVER_RUNTIME_BYTES


def memory_problem(model_dir: Path, cfg: ServingConfig, machine: MachineMemory) -> str | None:
    """Why a second server of `model_dir` would not fit beside what runs now, or None."""
    need = server_bytes(model_dir, cfg)
    if need <= machine.available:
        return None
    return (f"a canary server of {model_dir} needs about {gib(need)} GiB (weights, serving.kv_cache_gib="
            f"{cfg.kv_cache_gib:g} and vLLM's process), more than the {gib(machine.available)} GiB available "
            f"({machine.describe()}); lower serving.kv_cache_gib, stop other processes, or deploy without a canary")


def start_record(state_dir: Path, endpoint: Endpoint, champion: Endpoint, share: float) -> Canary:
    """Make the checked server `endpoint` the canary of `champion` (under the deploy lock)."""
    canary = Canary(endpoint, share, champion.version, time.time())
    write_json_atomic(Path(state_dir) / CANARY, canary.to_dict())
    append_history(Path(state_dir), "canary", endpoint, champion, share=share)
    return canary


def refuse_if_running(state_dir: Path, what: str) -> None:
    """ServingError when a canary runs: it must be decided before another deploy."""
    if (canary := read_canary(state_dir)) is not None:
        raise ServingError(f"{what} refused: {canary.endpoint.served_model_name} is serving as a canary "
                           f"(share {canary.share:g}); end it first with `rlhf canary promote` or `rlhf canary roll-back`")


def canary_arms(store, canary: Canary) -> tuple[Arm, Arm]:
    """(champion, canary): thumbs up of all thumbs each version got on answers since the canary started."""
    counts = store.thumbs_by_version(since=canary.started_at)
    champion = counts.get(canary.champion_version, (0, 0))
    mine = counts.get(canary.endpoint.version, (0, 0))
    return Arm(champion[0], sum(champion)), Arm(mine[0], sum(mine))


def decide_canary(store, canary: Canary, cfg: CanaryConfig, now: float | None = None) -> Decision:
    """The canary's call now (`always_valid.decide`); past `cfg.max_hours` a call still open rolls
    back, and so does a canary whose answers fail a counter-metric (`canary_guards`)."""
    champion, mine = canary_arms(store, canary)
    decision = decide(champion, mine, margin=cfg.margin, alpha=cfg.alpha, min_ratings=cfg.min_ratings,
                      max_ratings=cfg.max_ratings)
    if decision.action != "roll_back":
        versions = [canary.champion_version, canary.endpoint.version]
        answers = store.answers_by_version(canary.started_at, versions)
        if fired := [g.reason for g in guards(answers, *versions, cfg) if g.fired]:
            return Decision("roll_back", decision.difference, decision.low, decision.high, decision.ratings,
                            "; ".join(fired) + f" (thumbs: {decision.reason})")
    hours = ((now or time.time()) - canary.started_at) / 3600
    if decision.action == "continue" and hours >= cfg.max_hours:
        return Decision("roll_back", decision.difference, decision.low, decision.high, decision.ratings,
                        f"{decision.reason}; still open after serving.canary.max_hours={cfg.max_hours:g}, the champion stays")
    return decision


def finish_canary(state_dir: Path, action: str, drain_timeout_s: float, api_key: str, retire) -> Endpoint:
    """End the canary by `action` ("promote" | "roll_back"); the endpoint that serves after.
    `retire(endpoint, api_key, timeout_s)` drains and stops the server taken out of service."""
    if action not in ("promote", "roll_back"):
        raise ValueError(f"a canary ends by promote or roll_back, not {action!r}")
    state_dir = Path(state_dir)
    with deploy_lock(state_dir):
        canary, champion = read_canary(state_dir), recorded_endpoint(state_dir)  # a dead one's orphans end too
        if canary is None:
            raise ServingError("no canary is running")
        if action == "promote":
            write_json_atomic(state_dir / "current.json", canary.endpoint.to_dict())
            (state_dir / CANARY).unlink()
            append_history(state_dir, "deployed", canary.endpoint, champion, canary="promoted")
            serving, retired = canary.endpoint, champion
        else:
            (state_dir / CANARY).unlink()  # from here on every user goes to the champion
            append_history(state_dir, "stopped", canary.endpoint, None, canary="rolled_back")
            serving, retired = champion, canary.endpoint
        if retired is not None:
            retire(retired, api_key, drain_timeout_s)
    return serving


def drop_record(state_dir: Path) -> Canary | None:
    """Remove canary.json (its server is stopped by the caller); the canary it held, if any."""
    canary = read_canary(state_dir)
    with contextlib.suppress(FileNotFoundError):
        (Path(state_dir) / CANARY).unlink()
    return canary
