"""The feedback gateway in front of a real vLLM server, run as `rlhf gateway` in its own process:
answers through the `openai` client (plain, chat through the demo's template, streamed, n=2) are
recorded and rateable by signed users, bodies over the limit are refused by the real HTTP server
too, and a gateway killed with SIGKILL in the middle of a stream of ratings has lost none it
acknowledged. Last, a canary beside the champion: rolled back when its users rate it worse,
promoted when they rate it better, with no request dropped across either switch.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rlhf_core.config import ServingConfig
from rlhf_core.feedback.store import FeedbackStore, sqlite_url
from rlhf_core.serving.server import deploy, stop
from rlhf_core.serving.user_auth import USER_SECRET_FILE, sign_user
from rlhf_core.testing.gateway_process import running_gateway, start_gateway
from rlhf_core.testing.models import tiny_policy_dir

pytestmark = pytest.mark.slow


# a canary's test on fewer ratings than the default's 100 each, and rates far apart: a call in seconds
CANARY_SETTINGS = ("serving.canary.share=0.5", "serving.canary.min_ratings=20", "serving.canary.margin=0.1")


@dataclass
class Served:
    state_dir: Path
    output_dir: Path
    cfg: ServingConfig
    key: str


@pytest.fixture(scope="module")
def served(tmp_path_factory, free_ports):
    tmp = tmp_path_factory.mktemp("gateway")
    model_dir = tiny_policy_dir(tmp / "policy")  # the demo tokenizer, with its chat template
    cfg = ServingConfig(ports=tuple(free_ports(2)), api_key_env="RLHF_TEST_GATEWAY_KEY_UNSET",
                        smoke_prompt="12+34=", kv_cache_gib=0.25)
    state_dir = tmp / "serving"
    deploy(model_dir, "1", cfg, state_dir)
    yield Served(state_dir, tmp, cfg, (state_dir / "api_key").read_text().strip())
    stop(state_dir)


def gateway_args(served: Served, port: int, *extra: str) -> list[str]:
    sets = [f"output_dir={served.output_dir}", f"serving.state_dir={served.state_dir}",
            f"serving.api_key_env={served.cfg.api_key_env}", f"serving.ports=[{served.cfg.ports[0]},{served.cfg.ports[1]}]",
            "feedback.user_secret_env=RLHF_TEST_GATEWAY_USER_SECRET_UNSET", f"feedback.port={port}", *CANARY_SETTINGS,
            *extra]
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def gateway(served, free_ports):
    port = free_ports(1)[0]
    with running_gateway(gateway_args(served, port), port) as url:
        yield url


@pytest.fixture(scope="module")
def openai_client(served, gateway):
    from openai import OpenAI

    return OpenAI(base_url=f"{gateway}/v1", api_key=served.key, max_retries=0)


def store(served) -> FeedbackStore:
    return FeedbackStore(sqlite_url(served.state_dir / "feedback.db"))


def user_secret(served: Served) -> str:
    """The user-signing secret the gateway generated in the state dir when it started."""
    return (served.state_dir / USER_SECRET_FILE).read_text().strip()


def rate(gateway: str, served: Served, as_user: str, **body) -> httpx.Response:
    """A rating as an application sends it: the API key, and `as_user`'s id signed."""
    headers = {"Authorization": f"Bearer {served.key}", **sign_user(user_secret(served), as_user)}
    return httpx.post(f"{gateway}/v1/feedback", json=body, headers=headers, timeout=30)


def test_a_completion_through_the_gateway_is_recorded_and_rateable(served, gateway, openai_client):
    out = openai_client.completions.create(model="policy", prompt="12+34=", max_tokens=4, temperature=0,
                                           user="alice", extra_headers=sign_user(user_secret(served), "alice"))
    assert out.id.startswith("resp-") and out.model == "policy-v1"
    r = rate(gateway, served, "alice", response_id=out.id, rating="up", user="alice")
    assert r.status_code == 200 and r.json()["status"] == "created"
    s = store(served)
    ratings, _ = s.feedback_between(0, 1e12)
    mine = [x for x in ratings if x["response_id"] == out.id]
    assert [(x["text"], x["prompt"], x["model_version"], x["thumb"]) for x in mine] == [
        (out.choices[0].text, "12+34=", "1", 1)]
    s.close()


def test_the_demo_model_chats_through_its_template_as_it_completes(served, gateway, openai_client):
    """One user message is the demo's prompt, BOS included: the greedy answer is the completion's."""
    chat = openai_client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "12+34="}], max_tokens=4, temperature=0)
    text = openai_client.completions.create(model="policy", prompt="12+34=", max_tokens=4, temperature=0)
    assert chat.id.startswith("resp-") and chat.choices[0].message.content
    assert chat.choices[0].message.content == text.choices[0].text
    assert chat.usage.prompt_tokens == text.usage.prompt_tokens


def test_a_streamed_chat_is_recorded_as_the_client_saw_it(served, gateway, openai_client):
    stream = openai_client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "12+34="}], max_tokens=6, temperature=0, stream=True)
    ids, text = set(), []
    for chunk in stream:
        ids.add(chunk.id)
        text += [c.delta.content or "" for c in chunk.choices]
    [rid] = ids
    assert rate(gateway, served, "carol", response_id=rid, rating="down", comment="wrong").status_code == 200
    s = store(served)
    [row] = [x for x in s.feedback_between(0, 1e12)[0] if x["response_id"] == rid]
    assert row["text"] == "".join(text) and row["prompt"] == [{"role": "user", "content": "12+34="}]
    s.close()


def test_two_samples_to_choose_between(served, gateway, openai_client):
    out = openai_client.completions.create(model="policy", prompt="56+78=", max_tokens=4, temperature=1.0, n=2,
                                           seed=3)
    assert len(out.choices) == 2
    r = rate(gateway, served, "bob", response_id=out.id, preferred=1)
    assert r.status_code == 200 and r.json()["status"] == "created"
    s = store(served)
    [c] = [x for x in s.feedback_between(0, 1e12)[1] if x["response_id"] == out.id]
    assert c["answers"] == [ch.text for ch in sorted(out.choices, key=lambda ch: ch.index)]
    s.close()


def test_without_the_key_nothing_is_served(served, gateway):
    r = httpx.post(f"{gateway}/v1/completions", json={"prompt": "1+1=", "max_tokens": 2}, timeout=30)
    assert r.status_code == 401


def test_unsigned_ratings_are_refused_and_the_health_check_sees_vllm(served, gateway, openai_client):
    out = openai_client.completions.create(model="policy", prompt="12+34=", max_tokens=2, temperature=0)
    r = httpx.post(f"{gateway}/v1/feedback", json={"response_id": out.id, "rating": "up", "user": "alice"},
                   headers={"Authorization": f"Bearer {served.key}", "x-user-id": "alice"}, timeout=30)
    assert r.status_code == 401
    r = httpx.get(f"{gateway}/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok", "version": "1"}


def test_a_body_over_the_limit_is_413_from_the_real_server_chunked_or_not(served, gateway):
    big = b'{"prompt": "' + b"1" * 5_000_000 + b'", "max_tokens": 2}'
    headers = {"Authorization": f"Bearer {served.key}", "content-type": "application/json"}
    r = httpx.post(f"{gateway}/v1/completions", content=big, headers=headers, timeout=60)
    assert r.status_code == 413
    chunks = (big[i:i + 65536] for i in range(0, len(big), 65536))
    r = httpx.post(f"{gateway}/v1/completions", content=chunks, headers=headers, timeout=60)
    assert r.status_code == 413
    r = httpx.post(f"{gateway}/v1/completions", json={"prompt": "1+1=", "max_tokens": 2}, headers=headers,
                   timeout=60)
    assert r.status_code == 200


def test_a_gateway_killed_mid_stream_of_ratings_loses_none_it_acknowledged(served, free_ports, openai_client):
    response_ids = [openai_client.completions.create(model="policy", prompt=f"{10 + i}+11=", max_tokens=3,
                                                     temperature=0).id for i in range(4)]
    port = free_ports(1)[0]
    proc = start_gateway(gateway_args(served, port, "feedback.ratings_per_minute=100000"), port)
    url = f"http://127.0.0.1:{port}"
    acknowledged: list[tuple[str, str]] = []
    stop_sending = threading.Event()

    secret = user_secret(served)

    def send(worker: int) -> None:
        with httpx.Client(timeout=10, headers={"Authorization": f"Bearer {served.key}"}) as client:
            i = 0
            while not stop_sending.is_set():
                user, rid = f"kill-{worker}-{i}", response_ids[i % len(response_ids)]
                try:
                    r = client.post(f"{url}/v1/feedback", json={"response_id": rid, "rating": "up"},
                                    headers=sign_user(secret, user))
                except httpx.HTTPError:
                    return  # the gateway is gone
                if r.status_code == 200:
                    acknowledged.append((rid, user))
                i += 1

    senders = [threading.Thread(target=send, args=(w,)) for w in range(4)]
    for t in senders:
        t.start()
    time.sleep(3.0)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    stop_sending.set()
    for t in senders:
        t.join(timeout=20)
    assert len(acknowledged) > 20, "too few ratings were sent before the kill to test anything"

    from rlhf_core.feedback.store import hash_user

    salt = (served.state_dir / "user_salt").read_text().strip()
    s = store(served)
    stored = {(r["response_id"], r["user_hash"]) for r in s.feedback_between(0, 1e12)[0]}
    s.close()
    lost = [(rid, user) for rid, user in acknowledged if (rid, hash_user(user, salt)) not in stored]
    assert lost == [], f"{len(lost)} of {len(acknowledged)} acknowledged ratings are not in the store"


class Users:
    """Simulated users of the gateway: each asks, and rates what it got by which version answered."""

    def __init__(self, gateway: str, served: Served):
        self.gateway, self.served, self.secret = gateway, served, user_secret(served)
        self.client = httpx.Client(timeout=60, headers={"Authorization": f"Bearer {served.key}"})

    def ask(self, user: str, i: int) -> httpx.Response:
        return self.client.post(f"{self.gateway}/v1/completions", headers=sign_user(self.secret, user),
                                json={"model": "policy", "prompt": f"{10 + i % 80}+11=", "max_tokens": 3, "temperature": 0})

    def round(self, users: list[str], likes: dict[str, float]) -> dict[str, list[str]]:
        """Every user asks twice and rates both answers: up for a share `likes[served name]` of the
        users (the same users each time). -> the served names each user got."""
        got: dict[str, list[str]] = {}
        for i, user in enumerate(users * 2):
            r = self.ask(user, i)
            assert r.status_code == 200, r.text
            model = r.json()["model"]
            got.setdefault(user, []).append(model)
            up = (users.index(user) % 20) < 20 * likes[model]
            rated = self.client.post(f"{self.gateway}/v1/feedback", headers=sign_user(self.secret, user),
                                     json={"response_id": r.json()["id"], "rating": "up" if up else "down"})
            assert rated.status_code == 200, rated.text
        return got


class Traffic:
    """Requests sent without pause while a switch happens: every one must be answered."""

    def __init__(self, users: Users):
        self.users, self.statuses, self.stop = users, [], threading.Event()
        self.thread = threading.Thread(target=self._send)

    def _send(self):
        i = 0
        while not self.stop.is_set():
            try:
                self.statuses.append(self.users.ask(f"busy-{i % 7}", i).status_code)
            except httpx.HTTPError as e:
                self.statuses.append(repr(e))
            i += 1
            time.sleep(0.01)  # a client's pace, not a loop that takes a core from the tests beside it

    def __enter__(self):
        self.thread.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        time.sleep(0.5)
        self.stop.set()
        self.thread.join(timeout=60)


def _canary_metrics(gateway: str) -> dict[str, float]:
    text = httpx.get(f"{gateway}/metrics", timeout=10).text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line.startswith("rlhf_canary_decision")}


def test_a_canary_users_rate_worse_is_rolled_back_and_one_they_rate_better_is_promoted(served, gateway, mlflow_store,
                                                                                       tmp_path):
    from mlflow.tracking import MlflowClient

    from flows.cli import main as rlhf
    from rlhf_core.serving.canary import read_canary
    from rlhf_core.serving.process import port_in_use
    from tasks.registry import CHALLENGER, CHAMPION, POLICY, by_alias, promote, register_model_version

    client = MlflowClient(mlflow_store)
    exp = client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    for _ in range(3):
        run = client.create_run(exp)
        client.log_artifacts(run.info.run_id, str(served.output_dir / "policy"), "model")
        register_model_version(client, POLICY, run.info.run_id, "model", {"gate.passed": "true"})
    promote(client, "1", "test", "serves already")
    cli = ["--set", f"tracking.tracking_uri={mlflow_store}"] + [a for s in (
        f"output_dir={served.output_dir}", f"serving.state_dir={served.state_dir}",
        f"serving.api_key_env={served.cfg.api_key_env}", f"serving.ports=[{served.cfg.ports[0]},{served.cfg.ports[1]}]",
        f"serving.kv_cache_gib={served.cfg.kv_cache_gib}", f"serving.smoke_prompt={served.cfg.smoke_prompt}",
        *CANARY_SETTINGS) for a in ("--set", s)]
    users = Users(gateway, served)
    people = [f"user-{i}" for i in range(60)]

    # v2 as a canary for half the users, who like it far less than v1
    assert rlhf(["canary", "start", "2", *cli]) == 0
    canary = read_canary(served.state_dir)
    assert canary.share == 0.5 and canary.champion_version == "1" and str(by_alias(client, CHALLENGER).version) == "2"
    got = users.round(people, {"policy-v1": 0.8, "policy-v2": 0.2})
    assert all(len(set(names)) == 1 for names in got.values()), "a user was sent to both versions"
    on_canary = sum(names[0] == "policy-v2" for names in got.values())
    assert 15 <= on_canary <= 45, on_canary  # half of 60, within 4 standard deviations
    assert _canary_metrics(gateway)['rlhf_canary_decision{action="roll_back",version="2"}'] == 1.0
    with Traffic(users) as traffic:
        assert rlhf(["canary", "decide", *cli]) == 0
    assert traffic.statuses and set(traffic.statuses) == {200}, traffic.statuses
    assert read_canary(served.state_dir) is None and not port_in_use("127.0.0.1", canary.endpoint.port)
    tags = client.get_model_version(POLICY, "2").tags
    print(f"\nv2: {on_canary} of 60 users; {tags['canary.reason']}; thumbs {tags['canary.thumbs']}; "
          f"{len(traffic.statuses)} requests across the roll-back")
    assert tags["canary.decision"] == "roll_back" and "worse than the margin" in tags["canary.reason"]
    assert str(by_alias(client, CHAMPION).version) == "1" and by_alias(client, CHALLENGER) is None
    assert {users.ask(p, 0).json()["model"] for p in people[:10]} == {"policy-v1"}
    assert _canary_metrics(gateway) == {}

    # v3 as a canary, liked more than v1: promoted, and v1's server drained and stopped
    champion_port = server_port(served)
    assert rlhf(["canary", "start", "3", *cli]) == 0
    users.round(people, {"policy-v1": 0.5, "policy-v3": 0.95})
    with Traffic(users) as traffic:
        assert rlhf(["canary", "decide", *cli]) == 0
    assert traffic.statuses and set(traffic.statuses) == {200}, traffic.statuses
    assert str(by_alias(client, CHAMPION).version) == "3" and by_alias(client, CHALLENGER) is None
    tags = client.get_model_version(POLICY, "3").tags
    print(f"v3: {tags['canary.reason']}; thumbs {tags['canary.thumbs']}; {len(traffic.statuses)} requests across "
          "the promotion")
    assert tags["canary.decision"] == "promote" and tags["previous_champion"] == "1"
    assert tags["promotion_reason"].startswith("canary: canary minus champion thumbs-up rate +")
    assert read_canary(served.state_dir) is None and not port_in_use("127.0.0.1", champion_port)
    assert {users.ask(p, 0).json()["model"] for p in people[:10]} == {"policy-v3"}


def server_port(served: Served) -> int:
    from rlhf_core.serving.state import current_endpoint

    return current_endpoint(served.state_dir).port
