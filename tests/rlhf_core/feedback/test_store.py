"""The feedback store on a real SQLite file and a real PostgreSQL server: idempotent ratings,
choices, deletion, windows."""
import sqlite3
import threading

import pytest

from rlhf_core.feedback.store import Answer, FeedbackError, FeedbackStore, Recorded, hash_user, sqlite_url


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        s = FeedbackStore(sqlite_url(tmp_path / "feedback.db"))
    else:
        s = FeedbackStore(request.getfixturevalue("postgres_server")())
    yield s
    s.close()


@pytest.fixture
def sqlite_store(tmp_path):
    s = FeedbackStore(sqlite_url(tmp_path / "feedback.db"))
    yield s
    s.close()


def served(store, rid="r1", user="u1", answers=("046",), version="1", prompt="12+34="):
    store.record_response(rid, model_version=version, served_model=f"policy-v{version}", kind="completion",
                          prompt=prompt, user_hash=user, answers_=[Answer(a, "stop") for a in answers])


def test_sqlite_store_runs_in_wal_mode_with_full_sync(sqlite_store):
    with sqlite_store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1


def test_a_repeated_rating_counts_once_and_a_changed_one_replaces_it(store):
    served(store)
    assert store.rate("r1", "u2", thumb=1).status == "created"
    assert store.rate("r1", "u2", thumb=1).status == "duplicate"
    assert store.rate("r1", "u2", thumb=-1, comment="wrong sum").status == "updated"
    assert store.rate("r1", "u3", thumb=1).status == "created"
    assert store.counts()["ratings"] == 2
    assert store.thumbs_by_version() == {"1": (1, 1)}


def test_concurrent_identical_ratings_are_stored_once(store):
    served(store)
    statuses = []
    threads = [threading.Thread(target=lambda: statuses.append(store.rate("r1", "u2", thumb=1).status))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(statuses) == ["created"] + ["duplicate"] * 7
    assert store.counts()["ratings"] == 1


def test_unknown_responses_and_answers_are_refused_with_their_status(store):
    served(store, answers=("046", "036"))
    with pytest.raises(FeedbackError, match="unknown response_id 'nope'") as e:
        store.rate("nope", "u", thumb=1)
    assert e.value.status == 404
    with pytest.raises(FeedbackError, match="choice_index: 2 is not an answer") as e:
        store.rate("r1", "u", thumb=1, choice_index=2)
    assert e.value.status == 400
    served(store, rid="single")
    with pytest.raises(FeedbackError, match="has one answer"):
        store.choose("single", "u", 0)


def test_choices_join_the_answers_they_chose_between(store):
    served(store, answers=("046", "036"))
    assert store.choose("r1", "u2", 1).status == "created"
    assert store.choose("r1", "u2", 1).status == "duplicate"
    assert store.choose("r1", "u2", 0).status == "updated"
    ratings, choices = store.feedback_between(0, 1e12)
    assert ratings == []
    [c] = choices
    assert (c["prompt"], c["answers"], c["preferred_index"], c["model_version"]) == ("12+34=", ["046", "036"], 0, "1")


def test_feedback_between_is_a_half_open_window_on_the_last_write(store):
    served(store)
    store.rate("r1", "u2", thumb=1)
    ratings, _ = store.feedback_between(0, 1e12)
    t = ratings[0]["updated_at"]
    assert store.feedback_between(t, 1e12)[0] == []
    assert len(store.feedback_between(t - 1e-3, t)[0]) == 1


def test_deleting_a_user_removes_their_responses_and_ratings_and_keeps_the_rest(store):
    served(store, rid="theirs", user="gone")
    served(store, rid="mine", user="stays")
    store.rate("theirs", "stays", thumb=1)  # another user's rating of the deleted user's answer goes too
    store.rate("mine", "gone", thumb=-1)
    store.rate("mine", "stays", thumb=1)
    assert store.delete_user("gone") == {"ratings": 2, "choices": 0, "answers": 1, "responses": 1}
    assert store.counts() == {"responses": 1, "answers": 1, "ratings": 1, "choices": 0}
    assert store.thumbs_by_version() == {"1": (1, 0)}


def test_an_acknowledged_rating_is_in_the_file_for_another_process(sqlite_store, tmp_path):
    served(sqlite_store)
    sqlite_store.rate("r1", "u2", thumb=1)
    with sqlite3.connect(tmp_path / "feedback.db") as other:  # a reader that shares nothing with the store
        assert other.execute("SELECT thumb FROM ratings").fetchall() == [(1,)]


def test_user_hashes_depend_on_the_salt():
    assert hash_user("alice", "s1") == hash_user("alice", "s1") != hash_user("alice", "s2")
    assert len(hash_user("alice", "s1")) == 32 and "alice" not in hash_user("alice", "s1")


def test_apply_commits_many_writes_at_once_and_undoes_only_a_failed_one(store):
    served(store)
    results = store.apply([
        lambda conn: store.rate("r1", "u1", thumb=1, conn=conn),
        lambda conn: store.rate("nope", "u2", thumb=1, conn=conn),  # unknown: fails alone
        lambda conn: store.rate("r1", "u1", thumb=1, conn=conn),  # sees the first write of the batch
        lambda conn: store.record_response(
            "r1", model_version="1", served_model="p", kind="completion", prompt="p", user_hash="u",
            answers_=[Answer("x")], conn=conn),  # a second response under an existing id: fails alone
        lambda conn: store.rate("r1", "u3", thumb=-1, conn=conn),
    ])
    assert [r.status if isinstance(r, Recorded) else type(r).__name__ for r in results] == [
        "created", "FeedbackError", "duplicate", "IntegrityError", "created"]
    assert store.counts() == {"responses": 1, "answers": 1, "ratings": 2, "choices": 0}
