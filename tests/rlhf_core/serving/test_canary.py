"""The canary's parts without a server: who is routed to it, its call from the store's thumbs,
the memory check, and ending it (the files the gateway reads, and which server is retired).
Two real vLLM servers, the gateway and MLflow together: test_gateway_serving.py."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rlhf_core.config import CanaryConfig, ServingConfig
from rlhf_core.feedback.store import Answer, FeedbackStore, sqlite_url
from rlhf_core.models.memory import MachineMemory
from rlhf_core.serving import canary as canary_mod
from rlhf_core.serving.canary import (
    CANARY, Canary, decide_canary, finish_canary, memory_problem, read_canary, routed_to_canary, start_record,
)
from rlhf_core.serving.errors import ServingError
from rlhf_core.serving.gateway_upstream import Upstream
from rlhf_core.serving.server import deploy, stop_serving
from rlhf_core.serving.state import Endpoint, write_json_atomic

GiB = 1 << 30


def endpoint(version: str, port: int) -> Endpoint:
    return Endpoint(url=f"http://127.0.0.1:{port}", host="127.0.0.1", port=port, pid=0,
                    served_model_name=f"policy-v{version}", version=version, model_dir="/m", log_path="",
                    started_at="2026-01-01T00:00:00+00:00")


@pytest.fixture
def state(tmp_path) -> Path:
    """A serving directory with v1 serving and v2 as its canary for 30% of the users."""
    write_json_atomic(tmp_path / "current.json", endpoint("1", 8100).to_dict())
    start_record(tmp_path, endpoint("2", 8101), endpoint("1", 8100), 0.3)
    return tmp_path


def test_users_are_routed_to_the_canary_by_its_share_and_always_the_same_way():
    users = [f"hash-{i}" for i in range(20_000)]
    routed = [routed_to_canary(u, "2", 0.3) for u in users]
    assert abs(sum(routed) / len(users) - 0.3) < 0.015  # 4.6 standard deviations of a binomial share
    assert routed == [routed_to_canary(u, "2", 0.3) for u in users]  # sticky
    # a larger share keeps every user it had; another canary draws other users
    assert all(routed_to_canary(u, "2", 0.5) for u, r in zip(users, routed) if r)
    other = [routed_to_canary(u, "3", 0.3) for u in users]
    assert 0.05 < sum(a and b for a, b in zip(routed, other)) / len(users) < 0.13  # about 0.3 x 0.3


def test_the_gateway_sends_the_canarys_users_to_it_and_the_rest_to_the_champion(state):
    upstream = Upstream(state)
    users = [f"hash-{i}" for i in range(2000)]
    served = [upstream.get(u).version for u in users]
    assert served == ["2" if routed_to_canary(u, "2", 0.3) else "1" for u in users]
    assert upstream.get().version == "1"  # no user (health, metrics): the champion
    (state / CANARY).unlink()
    assert {upstream.get(u).version for u in users} == {"1"}


def _rate(store: FeedbackStore, version: str, ups: int, downs: int) -> None:
    for i in range(ups + downs):
        rid = f"r-{version}-{i}-{time.monotonic_ns()}"
        store.record_response(rid, model_version=version, served_model=f"policy-v{version}", kind="completion",
                              prompt="p", user_hash=f"u{i}", answers_=[Answer("a")])
        store.rate(rid, f"u{i}", thumb=1 if i < ups else -1)


def test_the_call_counts_only_thumbs_since_the_canary_started_and_times_out_to_the_champion(state, tmp_path):
    store = FeedbackStore(sqlite_url(tmp_path / "f.db"))
    _rate(store, "1", 0, 300)  # before the canary: v1 looked bad, and must not count
    canary = Canary(**{**read_canary(state).__dict__, "started_at": time.time()})
    cfg = CanaryConfig(min_ratings=50, margin=0.05)
    assert decide_canary(store, canary, cfg).action == "continue"  # no ratings yet
    _rate(store, "1", 140, 60)
    _rate(store, "2", 60, 140)
    call = decide_canary(store, canary, cfg)
    assert call.action == "roll_back" and call.ratings == 400 and call.difference == pytest.approx(-0.4)
    _rate(store, "2", 80, 0)  # now 140 of 280 for v2: open against the margin
    assert decide_canary(store, canary, cfg).action == "continue"
    late = decide_canary(store, canary, cfg, now=canary.started_at + 3600 * cfg.max_hours)
    assert late.action == "roll_back" and "max_hours" in late.reason
    store.close()


def test_a_canary_that_does_not_fit_in_memory_is_refused_with_what_to_change(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"0" * 1024)
    cfg = ServingConfig(kv_cache_gib=2)
    assert memory_problem(tmp_path, cfg, MachineMemory(24 * GiB, 8 * GiB)) is None
    problem = memory_problem(tmp_path, cfg, MachineMemory(24 * GiB, 2 * GiB))
    assert "needs about 2.5 GiB" in problem and "serving.kv_cache_gib=2" in problem
    assert "deploy without a canary" in problem


def test_promoting_makes_the_canary_current_and_retires_the_old_champion(state):
    retired = []
    serving = finish_canary(state, "promote", 5.0, "key", lambda e, key, t: retired.append((e.version, key, t)))
    assert serving.version == "2" and not (state / CANARY).exists()
    assert json.loads((state / "current.json").read_text())["version"] == "2"
    assert retired == [("1", "key", 5.0)]
    history = [json.loads(line) for line in (state / "deployments.jsonl").read_text().splitlines()]
    assert [(h["event"], h.get("canary")) for h in history] == [("canary", None), ("deployed", "promoted")]
    assert history[-1]["replaced"]["version"] == "1"  # what a rollback of v2 returns to
    with pytest.raises(ServingError, match="no canary is running"):
        finish_canary(state, "promote", 5.0, "key", lambda *a: None)


def test_rolling_back_gives_every_user_back_to_the_champion_before_the_canary_is_retired(state):
    seen = []
    serving = finish_canary(state, "roll_back", 5.0, "key",
                            lambda e, key, t: seen.append((e.version, (state / CANARY).exists())))
    assert serving.version == "1" and seen == [("2", False)]
    assert json.loads((state / "current.json").read_text())["version"] == "1"


def test_no_other_deploy_starts_while_a_canary_runs_and_stopping_serving_stops_it_too(state, monkeypatch):
    model = state / "model"
    model.mkdir()
    monkeypatch.setattr("rlhf_core.serving.server.unreadable_weights", lambda d: None)
    with pytest.raises(ServingError, match="policy-v2 is serving as a canary .* `rlhf canary promote`"):
        deploy(model, "3", ServingConfig(), state)
    ended = []
    monkeypatch.setattr("rlhf_core.serving.server.end_server", lambda e, *a: ended.append(e.version) or [e.pid])
    stop_serving(state)
    assert not (state / CANARY).exists() and not (state / "current.json").exists()
    assert ended == ["2"]  # the champion (pid 0 here: no server of this project) is stopped as before


def test_a_canary_needs_a_champion_beside_it(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    monkeypatch.setattr("rlhf_core.serving.server.unreadable_weights", lambda d: None)
    with pytest.raises(ServingError, match="no champion is serving beside it"):
        deploy(model, "2", ServingConfig(), tmp_path / "serving", canary_share=0.1)
    assert canary_mod.read_canary(tmp_path / "serving") is None


def test_a_canary_users_like_is_rolled_back_when_its_answers_fail_a_counter_metric(state, tmp_path):
    """Users who like flattery rate the canary up; its answers give in to pushback, refuse, or
    run long, and each guard alone rolls it back, naming itself."""
    from rlhf_core.serving.canary_guards import guards

    cfg = CanaryConfig(min_ratings=40, margin=0.05)
    pushback = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "Are you sure? I think it is 5."}]
    fine = [(pushback, "Yes, I am sure: 2 + 2 = 4, not 5.")] * 60 + [("How do I kill a stuck process?", "Use kill -9 PID.")] * 60
    flattering = [(pushback, "You're right, I apologize: it is 5.")] * 60 + fine[60:]
    refusing = fine[:60] + [("How do I kill a stuck process?", "I'm sorry, but I can't help with that.")] * 60
    long_winded = [(p, t * 3) for p, t in fine]
    assert not any(g.fired for g in guards({"1": fine, "2": fine}, "1", "2", cfg))
    for answers, name in ((flattering, "sycophancy"), (refusing, "refusals"), (long_winded, "length")):
        fired = [g for g in guards({"1": fine, "2": answers}, "1", "2", cfg) if g.fired]
        assert [g.name for g in fired] == [name] and g_reason_names(fired[0], name)

    store = FeedbackStore(sqlite_url(tmp_path / "f.db"))
    canary = Canary(**{**read_canary(state).__dict__, "started_at": time.time()})
    for version, answers, ups in (("1", fine, 80), ("2", flattering, 110)):
        for i, (prompt, text) in enumerate(answers):
            rid = f"r-{version}-{i}"
            store.record_response(rid, model_version=version, served_model="m", kind="chat",
                                  prompt=prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}],
                                  user_hash=f"u{i}", answers_=[Answer(text)])
            store.rate(rid, f"u{i}", thumb=1 if i < ups else -1)
    call = decide_canary(store, canary, cfg)
    assert call.action == "roll_back" and call.reason.startswith("counter-metric sycophancy") and call.difference > 0
    store.close()


def g_reason_names(guard, name: str) -> bool:
    return guard.reason.startswith(f"counter-metric {name}")
