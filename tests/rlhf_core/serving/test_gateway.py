"""The feedback gateway's API, in process (Starlette's test client) on a real SQLite store,
in front of a stand-in for vLLM on a real port (`fake_upstream`).

Serving through the gateway against a real vLLM server, streaming, and a gateway killed
with SIGKILL mid-stream of ratings are in tests/rlhf_core/serving/test_gateway_serving.py.
"""
import pytest
from starlette.testclient import TestClient

from rlhf_core.feedback.store import Answer, FeedbackStore, hash_user, sqlite_url
from rlhf_core.serving.gateway import BadRequest, Gateway, RateLimiter, Upstream, parse_feedback
from rlhf_core.serving.user_auth import ANONYMOUS, UserAuth, sign_user

KEY, SALT, USER_SECRET, ADMIN = "test-key", "test-salt", "test-user-signing-secret", "test-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
USERS = UserAuth(USER_SECRET, admin_key=ADMIN)


def signed(user: str, secret: str = USER_SECRET, **kw) -> dict:
    """The API key and `user`'s signed id: how an application calls for one of its users."""
    return AUTH | sign_user(secret, user, **kw)


@pytest.fixture
def gateway(tmp_path):
    store = FeedbackStore(sqlite_url(tmp_path / "feedback.db"))
    gw = Gateway(store, tmp_path / "serving", KEY, SALT, users=USERS, ratings_per_minute=5)
    store.record_response("resp-1", model_version="1", served_model="policy-v1", kind="completion",
                          prompt="12+34=", user_hash=hash_user("asker", SALT), answers_=[Answer("046")])
    store.record_response("resp-2", model_version="1", served_model="policy-v1", kind="chat",
                          prompt=[{"role": "user", "content": "12+34="}], user_hash=hash_user("asker", SALT),
                          answers_=[Answer("046"), Answer("036")])
    yield gw
    store.close()


@pytest.fixture
def client(gateway):
    with TestClient(gateway.app()) as c:
        yield c


def post(client, body, headers=None):
    return client.post("/v1/feedback", json=body, headers=signed("alice") if headers is None else headers)


def test_feedback_needs_the_serving_key(client, gateway):
    assert post(client, {"response_id": "resp-1", "rating": "up"}, headers=sign_user(USER_SECRET, "alice")
                ).status_code == 401
    wrong = {"Authorization": "Bearer not-the-key"} | sign_user(USER_SECRET, "alice")
    assert post(client, {"response_id": "resp-1", "rating": "up"}, headers=wrong).status_code == 401
    assert gateway.store.counts()["ratings"] == 0
    assert client.get("/livez").status_code == 200 and client.get("/metrics").status_code == 200
    assert client.get("/health").status_code == 503  # no key needed; nothing serves


def test_a_rating_is_recorded_once_however_often_it_is_sent(client, gateway):
    body = {"response_id": "resp-1", "rating": "up", "user": "alice"}
    assert post(client, body).json()["status"] == "created"
    assert post(client, body).json()["status"] == "duplicate"
    assert post(client, body | {"rating": "down"}).json()["status"] == "updated"
    assert gateway.store.counts()["ratings"] == 1
    metrics = client.get("/metrics").text
    assert 'rlhf_gateway_feedback_duplicates_total 1.0' in metrics
    assert 'rlhf_feedback_thumbs{thumb="down",version="1"} 1.0' in metrics


def test_an_unknown_response_id_is_404(client):
    r = post(client, {"response_id": "resp-nope", "rating": "up"})
    assert r.status_code == 404
    assert r.json()["error"]["field"] == "response_id" and "resp-nope" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, field", [
    ({"rating": "up"}, "response_id"),
    ({"response_id": 7, "rating": "up"}, "response_id"),
    ({"response_id": "resp-1"}, "rating"),
    ({"response_id": "resp-1", "rating": "great"}, "rating"),
    ({"response_id": "resp-1", "score": "high"}, "score"),
    ({"response_id": "resp-1", "score": True}, "score"),
    ({"response_id": "resp-1", "rating": "up", "choice_index": "0"}, "choice_index"),
    ({"response_id": "resp-1", "rating": "up", "choice_index": 3}, "choice_index"),
    ({"response_id": "resp-2", "preferred": 1, "rating": "up"}, "preferred"),
    ({"response_id": "resp-1", "preferred": 0}, "preferred"),
    ({"response_id": "resp-2", "preferred": 5}, "preferred"),
    ({"response_id": "resp-1", "rating": "up", "comment": 5}, "comment"),
    ({"response_id": "resp-1", "rating": "up", "stars": 5}, "stars"),
    ({"response_id": "resp-1", "rating": "up", "user": "mallory"}, "user"),  # the signed user is alice
    ([1, 2], "body"),
])
def test_malformed_feedback_is_400_naming_the_field(client, gateway, body, field):
    r = post(client, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field, r.json()
    assert gateway.store.counts()["ratings"] == gateway.store.counts()["choices"] == 0


def test_a_body_that_is_not_json_is_400(client):
    r = client.post("/v1/feedback", content=b"{not json",
                    headers=signed("alice") | {"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "body"


def test_a_choice_between_two_answers_is_recorded(client, gateway):
    r = post(client, {"response_id": "resp-2", "preferred": 0, "user": "bob"}, headers=signed("bob"))
    assert r.status_code == 200 and r.json()["status"] == "created"
    _, choices = gateway.store.feedback_between(0, 1e12)
    assert [(c["answers"], c["preferred_index"]) for c in choices] == [(["046", "036"], 0)]


def test_a_flood_from_one_user_is_limited_and_counted_and_others_still_rate(client, gateway):
    codes = [post(client, {"response_id": "resp-1", "score": float(i)}, headers=signed("flood")).status_code
             for i in range(8)]
    assert codes == [200] * 5 + [429] * 3
    assert post(client, {"response_id": "resp-1", "rating": "up"}, headers=signed("calm")).status_code == 200
    assert 'rlhf_gateway_feedback_rejected_total{reason="rate_limited"} 3.0' in client.get("/metrics").text


def test_the_user_is_the_signed_one_and_is_stored_hashed(client, gateway):
    assert post(client, {"response_id": "resp-1", "rating": "up"}, headers=signed("carol")).status_code == 200
    ratings, _ = gateway.store.feedback_between(0, 1e12)
    assert [r["user_hash"] for r in ratings] == [hash_user("carol", SALT)]


def test_deleting_a_user_takes_their_feedback_and_responses(client, gateway):
    post(client, {"response_id": "resp-1", "rating": "up"}, headers=signed("dave"))
    r = client.delete("/v1/users/asker", headers=signed("asker"))
    assert r.status_code == 200 and r.json()["deleted"]["responses"] == 2
    assert client.delete("/v1/users/asker", headers=sign_user(USER_SECRET, "asker")).status_code == 401  # no key
    assert gateway.store.counts() == {"responses": 0, "answers": 0, "ratings": 0, "choices": 0}


def test_serving_without_a_deployment_is_503_and_a_bad_n_is_400(client):
    r = client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 503 and "no model is being served" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "1+1=", "n": 9}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["field"] == "n"


def test_the_rate_limiter_frees_a_slot_sixty_seconds_after_it_was_taken():
    now = [0.0]
    limiter = RateLimiter(2, clock=lambda: now[0])
    assert [limiter.allow("u") for _ in range(3)] == [True, True, False]
    now[0] = 59.9
    assert not limiter.allow("u") and limiter.allow("other")
    now[0] = 60.0  # both slots were taken at 0
    assert [limiter.allow("u") for _ in range(3)] == [True, True, False]


def test_parse_feedback_never_takes_the_user_from_the_body():
    assert parse_feedback({"response_id": "r", "rating": "up"}, "signed").user == "signed"
    assert parse_feedback({"response_id": "r", "rating": "up", "user": "signed"}, "signed").user == "signed"
    with pytest.raises(BadRequest, match="user"):
        parse_feedback({"response_id": "r", "rating": "up", "user": "someone-else"}, "signed")
    assert parse_feedback({"response_id": "r", "rating": "up", "user": "claimed"}, ANONYMOUS).user == ANONYMOUS


def test_the_upstream_follows_current_json_when_a_deploy_replaces_it(tmp_path):
    from rlhf_core.serving.state import Endpoint, write_json_atomic

    def endpoint(version: str, port: int) -> Endpoint:
        return Endpoint(url=f"http://127.0.0.1:{port}", host="127.0.0.1", port=port, pid=1,
                        served_model_name=f"policy-v{version}", version=version, model_dir="/m", log_path="/l",
                        started_at="2024-01-01T00:00:00+00:00")

    upstream = Upstream(tmp_path)
    assert upstream.get() is None
    write_json_atomic(tmp_path / "current.json", endpoint("1", 8100).to_dict())
    assert upstream.get().version == "1"
    write_json_atomic(tmp_path / "current.json", endpoint("2", 8101).to_dict())  # blue/green: a new file replaces it
    assert (upstream.get().version, upstream.get().port) == ("2", 8101)
    (tmp_path / "current.json").unlink()  # serving stopped
    assert upstream.get() is None


def test_metrics_name_the_current_and_previous_versions_thumbs(tmp_path):
    from rlhf_core.serving.gateway import served_versions
    from rlhf_core.serving.state import Endpoint, append_history, write_json_atomic

    def ep(version):
        return Endpoint(url="http://127.0.0.1:1", host="127.0.0.1", port=1, pid=1, served_model_name=f"policy-v{version}",
                        version=version, model_dir="/m", log_path="/l", started_at="2024-01-01T00:00:00+00:00")

    state = tmp_path / "serving"
    state.mkdir()
    assert served_versions(state) == {}
    append_history(state, "deployed", ep("1"), None)
    write_json_atomic(state / "current.json", ep("1").to_dict())
    assert served_versions(state) == {"current": "1"}
    append_history(state, "deployed", ep("2"), ep("1"))
    append_history(state, "failed", ep("3"), ep("2"))
    write_json_atomic(state / "current.json", ep("2").to_dict())
    assert served_versions(state) == {"current": "2", "previous": "1"}

    store = FeedbackStore(sqlite_url(tmp_path / "feedback.db"))
    for version, thumbs in (("1", [1, 1, -1]), ("2", [-1, -1])):
        for i, thumb in enumerate(thumbs):
            store.record_response(f"r{version}{i}", model_version=version, served_model="p", kind="completion",
                                  prompt="p", user_hash="u", answers_=[Answer("a")])
            store.rate(f"r{version}{i}", f"u{i}", thumb=thumb)
    with TestClient(Gateway(store, state, KEY, SALT, users=USERS).app()) as c:
        text = c.get("/metrics").text
    assert 'rlhf_feedback_champion_thumbs{role="current",thumb="down",version="2"} 2.0' in text
    assert 'rlhf_feedback_champion_thumbs{role="previous",thumb="up",version="1"} 2.0' in text
    assert 'rlhf_gateway_serving_version{version="2"} 1.0' in text
    store.close()


def test_without_deploy_history_the_previous_version_is_the_one_served_before(tmp_path):
    """On Kubernetes the pod's init container announces its vLLM (no deployments.jsonl): the
    version it replaced is the one whose answers the store holds most recently."""
    from rlhf_core.serving.gateway import served_versions
    from rlhf_core.serving.state import announce

    store = FeedbackStore(sqlite_url(tmp_path / "feedback.db"))
    endpoint = announce(tmp_path / "state", url="http://127.0.0.1:8000", served_model_name="policy", version=3,
                        model_dir="/models/champion")
    assert (endpoint.host, endpoint.port, endpoint.version) == ("127.0.0.1", 8000, "3")
    assert Upstream(tmp_path / "state").get() == endpoint
    assert served_versions(tmp_path / "state", store) == {"current": "3"}
    for i, version in enumerate(["1", "2", "1", "2", "3"]):  # a rollback to 1, then 2 again, then 3
        store.record_response(f"r{i}", model_version=version, served_model="policy", kind="completion", prompt="p",
                              user_hash="u", answers_=[Answer("a")])
    assert served_versions(tmp_path / "state", store) == {"current": "3", "previous": "2"}
    assert served_versions(tmp_path / "state") == {"current": "3"}  # no store: unknown, not guessed
    store.close()


def test_the_store_url_comes_from_the_environment_before_the_config(tmp_path, monkeypatch):
    from rlhf_core.config import parse_config
    from rlhf_core.serving.gateway import store_url

    cfg = parse_config({"output_dir": str(tmp_path)})
    monkeypatch.delenv(cfg.feedback.store_url_env, raising=False)
    assert store_url(cfg) == sqlite_url(tmp_path.resolve() / "serving" / "feedback.db")
    cfg = parse_config({"output_dir": str(tmp_path), "feedback": {"store_url": "sqlite:///from-config.db"}})
    assert store_url(cfg) == "sqlite:///from-config.db"
    monkeypatch.setenv(cfg.feedback.store_url_env, "postgresql://rlhf:secret@db/feedback")
    assert store_url(cfg) == "postgresql://rlhf:secret@db/feedback"


def test_two_gateways_on_one_postgresql_store_count_a_users_rating_once(tmp_path, postgres_server):
    """Scale-out (a rollout's two pods): each pod's gateway on the same PostgreSQL store and
    salt; a rating sent to one and repeated to the other is one rating of one user."""
    url = postgres_server()
    stores = [FeedbackStore(url), FeedbackStore(url)]
    stores[0].record_response("resp-1", model_version="1", served_model="policy", kind="completion", prompt="12+34=",
                              user_hash=hash_user("asker", SALT), answers_=[Answer("046")])
    body = {"response_id": "resp-1", "rating": "up", "user": "alice"}
    with TestClient(Gateway(stores[0], tmp_path / "a", KEY, SALT, users=USERS).app()) as a, \
            TestClient(Gateway(stores[1], tmp_path / "b", KEY, SALT, users=USERS).app()) as b:
        assert post(b, body).json()["status"] == "created"
        assert post(a, body).json()["status"] == "duplicate"
        assert post(a, {"response_id": "resp-nope", "rating": "up"}).status_code == 404
        assert 'rlhf_feedback_thumbs{thumb="up",version="1"} 1.0' in b.get("/metrics").text
    assert stores[0].counts()["ratings"] == 1
    assert stores[1].delete_user(hash_user("alice", SALT))["ratings"] == 1
    for store in stores:
        store.close()


# --- users: who a credential says, not what a field says ----------------------------------------

def test_rotating_unsigned_user_ids_rates_nothing(client, gateway):
    """One client of the shared key sending 75 ratings, each under a new claimed user id, in the
    body and in x-user-id: without a signature no id is believed and nothing is recorded."""
    codes = [post(client, {"response_id": "resp-1", "rating": "up", "user": f"rot-{i}"},
                  headers=AUTH | {"x-user-id": f"rot-{i}"}).status_code for i in range(75)]
    assert codes == [401] * 75
    r = post(client, {"response_id": "resp-1", "rating": "up"}, headers=AUTH)
    assert r.status_code == 401 and "x-user-signature" in r.json()["error"]["message"]
    assert gateway.store.counts()["ratings"] == 0
    assert 'rlhf_gateway_feedback_rejected_total{reason="unauthenticated"} 76.0' in client.get("/metrics").text


def test_forged_altered_or_expired_signatures_are_refused(client, gateway):
    import time

    forged = signed("eve", secret="a-guessed-secret")
    borrowed = signed("alice") | {"x-user-id": "eve"}  # alice's signature under another id
    expired = signed("alice", expires=int(time.time()) - 5)
    extended = expired | {"x-user-expires": str(int(time.time()) + 3600)}  # the MAC covers the expiry
    garbage = signed("alice") | {"x-user-signature": "ünïcode".encode()}
    for headers in (forged, borrowed, expired, extended, garbage):
        r = post(client, {"response_id": "resp-1", "rating": "up"}, headers=headers)
        assert r.status_code == 401, (headers, r.text)
    assert post(client, {"response_id": "resp-1", "rating": "up"},
                headers=signed("alice", expires=int(time.time()) + 60)).status_code == 200
    assert gateway.store.counts()["ratings"] == 1


def test_anonymous_ratings_share_one_rate_limit_bucket(tmp_path):
    """With unsigned feedback recorded as anonymous, rotating claimed ids buys nothing: they are
    all one user, limited to ratings_per_minute together."""
    store = FeedbackStore(sqlite_url(tmp_path / "feedback.db"))
    store.record_response("resp-1", model_version="1", served_model="policy-v1", kind="completion", prompt="1+1=",
                          user_hash=hash_user("asker", SALT), answers_=[Answer("2")])
    users = UserAuth(USER_SECRET, admin_key=ADMIN, anonymous_ratings=True)
    with TestClient(Gateway(store, tmp_path / "serving", KEY, SALT, users=users, ratings_per_minute=5).app()) as c:
        codes = [post(c, {"response_id": "resp-1", "score": float(i), "user": f"rot-{i}"},
                      headers=AUTH | {"x-user-id": f"rot-{i}"}).status_code for i in range(75)]
        assert codes.count(200) == 5 and codes.count(429) == 70
        assert post(c, {"response_id": "resp-1", "rating": "up"}, headers=signed("alice")).status_code == 200
        assert post(c, {"response_id": "resp-1", "rating": "up"}, headers=signed("eve", "forged")).status_code == 401
    ratings, _ = store.feedback_between(0, 1e12)
    assert sorted(r["user_hash"] for r in ratings) == sorted([hash_user(ANONYMOUS, SALT), hash_user("alice", SALT)])
    store.close()


def test_a_signature_cannot_name_the_anonymous_user():
    with pytest.raises(ValueError):
        sign_user(USER_SECRET, ANONYMOUS)
    with pytest.raises(ValueError):
        sign_user(USER_SECRET, "has space")


def test_deleting_another_users_data_is_refused_but_the_owner_and_the_admin_may(client, gateway):
    post(client, {"response_id": "resp-1", "rating": "up"}, headers=signed("bob"))
    refused = [signed("mallory"), AUTH | {"x-user-id": "asker"}, signed("asker", secret="forged"),
               AUTH | {"x-admin-key": "not-the-admin-key"}, AUTH]
    for headers in refused:
        r = client.delete("/v1/users/asker", headers=headers)
        assert r.status_code == 403, (headers, r.text)
    assert gateway.store.counts() == {"responses": 2, "answers": 3, "ratings": 1, "choices": 0}
    r = client.delete("/v1/users/bob", headers=signed("bob"))
    assert r.status_code == 200 and r.json()["deleted"]["ratings"] == 1
    r = client.delete("/v1/users/asker", headers=AUTH | {"x-admin-key": ADMIN})
    assert r.status_code == 200 and r.json()["deleted"]["responses"] == 2
    assert gateway.store.counts() == {"responses": 0, "answers": 0, "ratings": 0, "choices": 0}


# --- serving: sizes, the upstream's health, what a failure tells the client ---------------------

@pytest.fixture
def upstream(gateway, tmp_path):
    from tests.rlhf_core.serving.fake_upstream import fake_upstream

    with fake_upstream(tmp_path / "serving") as fake:
        yield fake


def test_a_completion_is_recorded_under_its_signed_user_never_a_claimed_one(client, gateway, upstream):
    r = client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 2}, headers=signed("zoe"))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "046"
    r2 = client.post("/v1/completions", json={"prompt": "1+2=", "max_tokens": 2, "user": "zoe"},
                     headers=AUTH | {"x-user-id": "zoe"})
    assert r2.status_code == 200
    assert client.post("/v1/completions", json={"prompt": "1+3="}, headers=signed("zoe", "forged")).status_code == 401
    gateway.writer.submit(lambda conn: None).result(timeout=10)  # the records are queued before it
    assert client.delete("/v1/users/zoe", headers=signed("zoe")).json()["deleted"]["responses"] == 1
    assert client.delete("/v1/users/anonymous", headers=AUTH | {"x-admin-key": ADMIN}
                         ).json()["deleted"]["responses"] == 1


BIG = b'{"response_id": "resp-1", "rating": "up", "comment": "' + b"x" * 5_000_000 + b'"}'


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_completion_body_over_the_limit_is_413_and_never_forwarded(client, gateway, upstream, path):
    big = b'{"prompt": "' + b"1" * 5_000_000 + b'", "max_tokens": 2}'
    r = client.post(path, content=big, headers=signed("alice") | {"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["field"] == "body"
    request = client.build_request("POST", path, content=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]),
                                   headers=signed("alice") | {"content-type": "application/json"})
    assert "content-length" not in request.headers  # chunked: only the bytes read can tell
    assert client.send(request).status_code == 413
    assert upstream.completions() == []
    ok = client.post(path, json={"prompt": "1+1=", "messages": [{"role": "user", "content": "1+1="}]},
                     headers=signed("alice"))
    assert ok.status_code == 200 and len(upstream.completions()) == 1


def test_a_feedback_body_over_the_limit_is_413_before_it_is_parsed(client, gateway):
    r = client.post("/v1/feedback", content=BIG, headers=signed("alice") | {"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["field"] == "body"
    request = client.build_request("POST", "/v1/feedback", content=iter([BIG[:1000], BIG[1000:]]),
                                   headers=signed("alice") | {"content-type": "application/json"})
    assert "content-length" not in request.headers
    assert client.send(request).status_code == 413
    assert gateway.store.counts()["ratings"] == 0
    assert 'rlhf_gateway_feedback_rejected_total{reason="too_large"} 2.0' in client.get("/metrics").text


def test_a_streamed_body_is_read_no_further_than_its_limit():
    """`read_body` stops at the chunk that crosses the limit: the rest is never received."""
    import asyncio

    from starlette.requests import Request

    from rlhf_core.serving.gateway_limits import BodyTooLarge, read_body

    received = []

    async def receive():
        received.append(1000)
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}  # an endless body

    request = Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(request, 4500))
    assert sum(received) == 5000

    async def small():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    assert asyncio.run(read_body(Request({"type": "http", "method": "POST", "path": "/",
                                          "headers": [(b"content-length", b"2")]}, small), 2)) == b"{}"


def test_health_is_503_while_nothing_serves_or_the_upstream_is_dead(client, gateway, tmp_path):
    from tests.rlhf_core.serving.fake_upstream import announce_dead_upstream, fake_upstream

    r = client.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "unavailable", "reason": "no model is being served"}
    url = announce_dead_upstream(tmp_path / "serving")
    r = client.get("/health")
    assert r.status_code == 503 and url.split("//")[1] not in r.text and "127.0.0.1" not in r.text
    gateway.upstream.health_ttl_s = 0.0
    with fake_upstream(tmp_path / "serving", version="2") as fake:
        r = client.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok", "version": "2"}
        fake.health_status = 500
        assert client.get("/health").status_code == 503
    assert client.get("/livez").status_code == 200


def test_a_502_names_neither_the_upstream_nor_its_error(client, gateway, tmp_path, caplog):
    from tests.rlhf_core.serving.fake_upstream import announce_dead_upstream, fake_upstream

    url = announce_dead_upstream(tmp_path / "serving")
    port = url.rsplit(":", 1)[1]
    with caplog.at_level("WARNING", logger="rlhf_core.serving.gateway"):
        r = client.post("/v1/completions", json={"prompt": "1+1="}, headers=signed("alice"))
    assert r.status_code == 502, r.text
    assert r.json()["error"]["message"] == "the served model did not answer"
    for internal in ("127.0.0.1", port, "Connect", "Error", "refused"):
        assert internal not in r.text
    assert url in caplog.text  # the operator gets the details
    with fake_upstream(tmp_path / "serving") as fake:
        fake.completion_status, fake.completion_error = 500, "Traceback: /opt/vllm/engine.py secret-internal"
        r = client.post("/v1/chat/completions", json={"messages": [], "stream": True}, headers=signed("alice"))
        assert r.status_code == 502 and "secret-internal" not in r.text and "vllm" not in r.text
        fake.completion_status, fake.completion_error = 400, "max_tokens is too large"
        r = client.post("/v1/completions", json={"prompt": "1+1="}, headers=signed("alice"))
        assert r.status_code == 400 and r.text == "max_tokens is too large"  # the client's own mistake


def test_the_signature_is_the_documented_hmac():
    """docs/feedback.md tells applications in other languages how to sign: keep it true."""
    import hashlib
    import hmac

    def mac(message: str) -> str:
        return hmac.new(USER_SECRET.encode(), message.encode(), hashlib.sha256).hexdigest()

    assert sign_user(USER_SECRET, "alice") == {"x-user-id": "alice", "x-user-signature": mac("alice")}
    assert sign_user(USER_SECRET, "alice", expires=2000000000) == {
        "x-user-id": "alice", "x-user-expires": "2000000000", "x-user-signature": mac("alice\n2000000000")}


def test_the_gateway_of_a_config_resolves_its_secrets_as_the_api_key_is(tmp_path, monkeypatch):
    """The user-signing secret and the admin key: an environment variable, else a file generated
    (mode 0600) in the serving state dir, which the simulated users and applications read."""
    from rlhf_core.config import parse_config
    from rlhf_core.serving.gateway import build_gateway

    cfg = parse_config({"output_dir": str(tmp_path), "feedback": {"unsigned_ratings": "anonymous",
                                                                  "max_feedback_bytes": 100}})
    monkeypatch.delenv(cfg.feedback.user_secret_env, raising=False)
    monkeypatch.setenv(cfg.feedback.admin_key_env, "admin-from-env")
    gw = build_gateway(cfg)
    try:
        path = tmp_path.resolve() / "serving" / "user_signing_secret"
        assert gw.users.secret == path.read_text().strip() and len(gw.users.secret) >= 32
        assert path.stat().st_mode & 0o777 == 0o600
        assert gw.users.admin_key == "admin-from-env" and not (path.parent / "admin_key").exists()
        assert gw.users.anonymous_ratings and gw.max_bytes == {"feedback": 100, "completion": 1024 * 1024}
        again = build_gateway(cfg)
        again.writer.close()
        again.store.close()
        assert again.users.secret == gw.users.secret  # generated once, then reused
    finally:
        gw.writer.close()
        gw.store.close()
    assert parse_config({}).feedback.unsigned_ratings == "refuse"
