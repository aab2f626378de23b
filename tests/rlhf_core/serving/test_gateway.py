"""The feedback gateway's API, in process (Starlette's test client) on a real SQLite store.

Serving through the gateway against a real vLLM server, streaming, and a gateway killed
with SIGKILL mid-stream of ratings are in tests/rlhf_core/serving/test_gateway_serving.py.
"""
import pytest
from starlette.testclient import TestClient

from rlhf_core.feedback.store import Answer, FeedbackStore, hash_user, sqlite_url
from rlhf_core.serving.gateway import BadRequest, Gateway, RateLimiter, Upstream, parse_feedback

KEY, SALT = "test-key", "test-salt"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def gateway(tmp_path):
    store = FeedbackStore(sqlite_url(tmp_path / "feedback.db"))
    gw = Gateway(store, tmp_path / "serving", KEY, SALT, ratings_per_minute=5)
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


def post(client, body, headers=AUTH):
    return client.post("/v1/feedback", json=body, headers=headers)


def test_feedback_needs_the_serving_key(client, gateway):
    assert post(client, {"response_id": "resp-1", "rating": "up"}, headers={}).status_code == 401
    wrong = {"Authorization": "Bearer not-the-key"}
    assert post(client, {"response_id": "resp-1", "rating": "up"}, headers=wrong).status_code == 401
    assert gateway.store.counts()["ratings"] == 0
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


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
    ([1, 2], "body"),
])
def test_malformed_feedback_is_400_naming_the_field(client, gateway, body, field):
    r = post(client, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field, r.json()
    assert gateway.store.counts()["ratings"] == gateway.store.counts()["choices"] == 0


def test_a_body_that_is_not_json_is_400(client):
    r = client.post("/v1/feedback", content=b"{not json", headers=AUTH | {"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "body"


def test_a_choice_between_two_answers_is_recorded(client, gateway):
    r = post(client, {"response_id": "resp-2", "preferred": 0, "user": "bob"})
    assert r.status_code == 200 and r.json()["status"] == "created"
    _, choices = gateway.store.feedback_between(0, 1e12)
    assert [(c["answers"], c["preferred_index"]) for c in choices] == [(["046", "036"], 0)]


def test_a_flood_from_one_user_is_limited_and_counted_and_others_still_rate(client, gateway):
    codes = [post(client, {"response_id": "resp-1", "score": float(i), "user": "flood"}).status_code
             for i in range(8)]
    assert codes == [200] * 5 + [429] * 3
    assert post(client, {"response_id": "resp-1", "rating": "up", "user": "calm"}).status_code == 200
    assert 'rlhf_gateway_feedback_rejected_total{reason="rate_limited"} 3.0' in client.get("/metrics").text


def test_the_user_comes_from_the_body_or_the_header_and_is_stored_hashed(client, gateway):
    post(client, {"response_id": "resp-1", "rating": "up"}, headers=AUTH | {"x-user-id": "carol"})
    ratings, _ = gateway.store.feedback_between(0, 1e12)
    assert [r["user_hash"] for r in ratings] == [hash_user("carol", SALT)]


def test_deleting_a_user_takes_their_feedback_and_responses(client, gateway):
    post(client, {"response_id": "resp-1", "rating": "up", "user": "dave"})
    r = client.delete("/v1/users/asker", headers=AUTH)
    assert r.status_code == 200 and r.json()["deleted"]["responses"] == 2
    assert client.delete("/v1/users/asker").status_code == 401
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


def test_parse_feedback_takes_the_header_user_when_the_body_has_none():
    assert parse_feedback({"response_id": "r", "rating": "up"}, "hdr").user == "hdr"
    assert parse_feedback({"response_id": "r", "rating": "up", "user": "body"}, "hdr").user == "body"
    with pytest.raises(BadRequest, match="user"):
        parse_feedback({"response_id": "r", "rating": "up", "user": 5}, None)


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
    with TestClient(Gateway(store, state, KEY, SALT).app()) as c:
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
    with TestClient(Gateway(stores[0], tmp_path / "a", KEY, SALT).app()) as a, \
            TestClient(Gateway(stores[1], tmp_path / "b", KEY, SALT).app()) as b:
        assert post(b, body).json()["status"] == "created"
        assert post(a, body).json()["status"] == "duplicate"
        assert post(a, {"response_id": "resp-nope", "rating": "up"}).status_code == 404
        assert 'rlhf_feedback_thumbs{thumb="up",version="1"} 1.0' in b.get("/metrics").text
    assert stores[0].counts()["ratings"] == 1
    assert stores[1].delete_user(hash_user("alice", SALT))["ratings"] == 1
    for store in stores:
        store.close()
