"""The feedback store: every answer the gateway served, and what users said about it.

SQLAlchemy Core on any database URL: SQLite by default (one file, WAL journal, `synchronous
= FULL`, so a rating is on disk before the gateway acknowledges it, even if the machine loses
power right after), PostgreSQL or another server when several gateways share one store, as
Prefect and MLflow do.

Tables:

    responses   one row per request served: id (the response id the client got), time,
                the registry version and served name that answered, the kind of request
                (`chat` or `completion`), the request's prompt as JSON, the hashed user, n
    answers     one row per answer of a response (n > 1 when the client asked for samples
                to choose between): text, finish reason
    ratings     a user's rating of one answer: thumb (+1 up, -1 down), score, comment; one per
                (response, answer, user): a repeated rating replaces the earlier one
    choices     a user's choice between the answers of one response; one per (response, user)
    exports     what `collect-feedback` exported: the time it covered up to, the dataset's
                version, fingerprint and directory

Every write is one transaction. User ids are never stored: the gateway hashes them with a
secret salt (`hash_user`) and the store only sees the hash, which is also what deleting a
user's data goes by.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Column, Float, ForeignKey, Integer, MetaData, String, Table, Text, UniqueConstraint, create_engine, delete, event,
    func, insert, select, update,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

metadata = MetaData()

responses = Table(
    "responses", metadata,
    Column("id", String(64), primary_key=True),
    Column("created_at", Float, nullable=False, index=True),
    Column("model_version", String(64), nullable=False, index=True),
    Column("served_model", String(256), nullable=False),
    Column("kind", String(16), nullable=False),  # chat | completion
    Column("prompt_json", Text, nullable=False),  # the messages (chat) or the prompt text (completion), as JSON
    Column("user_hash", String(64), nullable=False, index=True),
    Column("n", Integer, nullable=False),
)
answers = Table(
    "answers", metadata,
    Column("response_id", String(64), ForeignKey("responses.id", ondelete="CASCADE"), primary_key=True),
    Column("choice_index", Integer, primary_key=True),
    Column("text", Text, nullable=False),
    Column("finish_reason", String(32)),
)
ratings = Table(
    "ratings", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("response_id", String(64), ForeignKey("responses.id", ondelete="CASCADE"), nullable=False),
    Column("choice_index", Integer, nullable=False),
    Column("user_hash", String(64), nullable=False, index=True),
    Column("thumb", Integer),  # +1 up, -1 down, null: a score only
    Column("score", Float),
    Column("comment", Text),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False, index=True),
    UniqueConstraint("response_id", "choice_index", "user_hash", name="one_rating_per_user"),
)
choices = Table(
    "choices", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("response_id", String(64), ForeignKey("responses.id", ondelete="CASCADE"), nullable=False),
    Column("user_hash", String(64), nullable=False, index=True),
    Column("preferred_index", Integer, nullable=False),
    Column("comment", Text),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False, index=True),
    UniqueConstraint("response_id", "user_hash", name="one_choice_per_user"),
)
exports = Table(
    "exports", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("created_at", Float, nullable=False),
    Column("covered_until", Float, nullable=False),
    Column("version", String(64), nullable=False, unique=True),
    Column("fingerprint", String(64), nullable=False),
    Column("path", Text, nullable=False),
)


class FeedbackError(ValueError):
    """Feedback the store cannot take; `status` is the HTTP status the gateway answers with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def hash_user(user: str, salt: str) -> str:
    """The id stored for a user: HMAC-SHA-256 under the gateway's secret salt, so the store
    alone cannot be joined back to user ids."""
    return hmac.new(salt.encode(), user.encode(), hashlib.sha256).hexdigest()[:32]


def sqlite_url(path: str | Path) -> str:
    return f"sqlite:///{Path(path).resolve()}"


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
    cursor.execute("PRAGMA synchronous=FULL")  # a commit is on disk before it returns
    cursor.execute("PRAGMA foreign_keys=ON")  # deleting a response deletes its answers and ratings
    cursor.execute("PRAGMA busy_timeout=10000")  # concurrent writers wait instead of failing
    cursor.close()


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str | None = None


@dataclass(frozen=True)
class Recorded:
    """What a feedback write did: `created` (new), `updated` (the user changed their earlier
    rating or choice) or `duplicate` (the same again: counted once)."""

    status: str
    model_version: str


class FeedbackStore:
    """The store at `url` (created on first use)."""

    def __init__(self, url: str):
        self.url = url
        self.engine: Engine = create_engine(url, future=True)
        if self.engine.dialect.name == "sqlite":
            if self.engine.url.database not in (None, "", ":memory:"):
                Path(self.engine.url.database).parent.mkdir(parents=True, exist_ok=True)
            event.listen(self.engine, "connect", _sqlite_pragmas)
        metadata.create_all(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    # --- served answers -------------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self, conn: Connection | None):
        """A transaction of its own, or a savepoint inside `conn`'s (see `apply`)."""
        if conn is not None:
            with conn.begin_nested():
                yield conn
        else:
            with self.engine.begin() as own:
                yield own

    def apply(self, calls: list[Callable[[Connection], Any]]) -> list[Any]:
        """Run `calls` in one transaction, each in a savepoint of its own: one commit (one
        fsync) for many writes. -> each call's result, or the exception it raised (its own
        writes undone, the others kept)."""
        results: list[Any] = []
        with self.engine.begin() as conn:
            for call in calls:
                try:
                    results.append(call(conn))
                except Exception as e:  # noqa: BLE001 - handed back to the caller it belongs to
                    results.append(e)
        return results

    def record_response(self, response_id: str, *, model_version: str, served_model: str, kind: str,
                        prompt: Any, user_hash: str, answers_: list[Answer], created_at: float | None = None,
                        conn: Connection | None = None) -> None:
        """One served response and its answers, in one transaction."""
        with self._transaction(conn) as conn:
            conn.execute(insert(responses).values(
                id=response_id, created_at=created_at or time.time(), model_version=model_version,
                served_model=served_model, kind=kind, prompt_json=json.dumps(prompt), user_hash=user_hash,
                n=len(answers_)))
            if answers_:
                conn.execute(insert(answers), [
                    {"response_id": response_id, "choice_index": i, "text": a.text, "finish_reason": a.finish_reason}
                    for i, a in enumerate(answers_)])

    def _response(self, conn, response_id: str):
        row = conn.execute(select(responses.c.model_version, responses.c.n)
                           .where(responses.c.id == response_id)).first()
        if row is None:
            raise FeedbackError(f"unknown response_id {response_id!r}", status=404)
        return row

    # --- feedback -------------------------------------------------------------------------

    def rate(self, response_id: str, user_hash: str, *, choice_index: int = 0, thumb: int | None = None,
             score: float | None = None, comment: str | None = None, conn: Connection | None = None) -> Recorded:
        """A user's rating of one answer; the same (response, answer, user) again replaces it."""
        now = time.time()
        with self._transaction(conn) as conn:
            version, n = self._response(conn, response_id)
            if not 0 <= choice_index < n:
                raise FeedbackError(f"choice_index: {choice_index} is not an answer of {response_id!r} "
                                    f"(it has {n})")
            key = ((ratings.c.response_id == response_id) & (ratings.c.choice_index == choice_index)
                   & (ratings.c.user_hash == user_hash))
            old = conn.execute(select(ratings.c.thumb, ratings.c.score, ratings.c.comment).where(key)).first()
            if old is None:
                try:
                    with conn.begin_nested():
                        conn.execute(insert(ratings).values(
                            response_id=response_id, choice_index=choice_index, user_hash=user_hash, thumb=thumb,
                            score=score, comment=comment, created_at=now, updated_at=now))
                    return Recorded("created", version)
                except IntegrityError:  # the same rating committed by a concurrent request
                    old = conn.execute(select(ratings.c.thumb, ratings.c.score, ratings.c.comment).where(key)).first()
            if tuple(old) == (thumb, score, comment):
                return Recorded("duplicate", version)
            conn.execute(update(ratings).where(key).values(thumb=thumb, score=score, comment=comment, updated_at=now))
            return Recorded("updated", version)

    def choose(self, response_id: str, user_hash: str, preferred_index: int, comment: str | None = None,
               conn: Connection | None = None) -> Recorded:
        """A user's choice between the answers of one response."""
        now = time.time()
        with self._transaction(conn) as conn:
            version, n = self._response(conn, response_id)
            if n < 2:
                raise FeedbackError(f"preferred: response {response_id!r} has one answer; a choice needs a "
                                    "response served with n >= 2")
            if not 0 <= preferred_index < n:
                raise FeedbackError(f"preferred: {preferred_index} is not an answer of {response_id!r} (it has {n})")
            key = (choices.c.response_id == response_id) & (choices.c.user_hash == user_hash)
            old = conn.execute(select(choices.c.preferred_index, choices.c.comment).where(key)).first()
            if old is None:
                try:
                    with conn.begin_nested():
                        conn.execute(insert(choices).values(
                            response_id=response_id, user_hash=user_hash, preferred_index=preferred_index,
                            comment=comment, created_at=now, updated_at=now))
                    return Recorded("created", version)
                except IntegrityError:
                    old = conn.execute(select(choices.c.preferred_index, choices.c.comment).where(key)).first()
            if tuple(old) == (preferred_index, comment):
                return Recorded("duplicate", version)
            conn.execute(update(choices).where(key).values(preferred_index=preferred_index, comment=comment,
                                                           updated_at=now))
            return Recorded("updated", version)

    def delete_user(self, user_hash: str, conn: Connection | None = None) -> dict[str, int]:
        """Every response, answer, rating and choice of one user; returns what was deleted.
        Responses a user asked for go with the other users' ratings of them."""
        with self._transaction(conn) as conn:
            own = select(responses.c.id).where(responses.c.user_hash == user_hash).scalar_subquery()
            counts = {
                "ratings": conn.execute(delete(ratings).where(
                    (ratings.c.user_hash == user_hash) | ratings.c.response_id.in_(own))).rowcount,
                "choices": conn.execute(delete(choices).where(
                    (choices.c.user_hash == user_hash) | choices.c.response_id.in_(own))).rowcount,
                "answers": conn.execute(delete(answers).where(answers.c.response_id.in_(own))).rowcount,
            }
            counts["responses"] = conn.execute(delete(responses).where(responses.c.user_hash == user_hash)).rowcount
        return counts

    # --- reading, for exports and metrics ------------------------------------------------

    def feedback_between(self, after: float, until: float) -> tuple[list[dict], list[dict]]:
        """Ratings and choices last written in (after, until], each joined with its response and
        answer(s): (ratings, choices) as plain dicts, oldest first."""
        rated = (select(ratings, responses.c.model_version, responses.c.kind, responses.c.prompt_json,
                        answers.c.text)
                 .join(responses, responses.c.id == ratings.c.response_id)
                 .join(answers, (answers.c.response_id == ratings.c.response_id)
                       & (answers.c.choice_index == ratings.c.choice_index))
                 .where((ratings.c.updated_at > after) & (ratings.c.updated_at <= until))
                 .order_by(ratings.c.updated_at, ratings.c.id))
        chosen = (select(choices, responses.c.model_version, responses.c.kind, responses.c.prompt_json)
                  .join(responses, responses.c.id == choices.c.response_id)
                  .where((choices.c.updated_at > after) & (choices.c.updated_at <= until))
                  .order_by(choices.c.updated_at, choices.c.id))
        with self.engine.connect() as conn:
            rating_rows = [dict(r._mapping) for r in conn.execute(rated)]
            choice_rows = [dict(r._mapping) for r in conn.execute(chosen)]
            texts: dict[str, dict[int, str]] = {}
            ids = sorted({c["response_id"] for c in choice_rows})
            for start in range(0, len(ids), 500):
                for rid, idx, text in conn.execute(select(answers.c.response_id, answers.c.choice_index, answers.c.text)
                                                   .where(answers.c.response_id.in_(ids[start:start + 500]))):
                    texts.setdefault(rid, {})[idx] = text
        for row in rating_rows + choice_rows:
            row["prompt"] = json.loads(row.pop("prompt_json"))
        for row in choice_rows:
            row["answers"] = [texts[row["response_id"]][i] for i in sorted(texts.get(row["response_id"], {}))]
        return rating_rows, choice_rows

    def thumbs_by_version(self, since: float | None = None) -> dict[str, tuple[int, int]]:
        """(thumbs up, thumbs down) per served version, on answers given since `since` (None: all time)."""
        query = (select(responses.c.model_version, ratings.c.thumb)
                 .join(responses, responses.c.id == ratings.c.response_id).where(ratings.c.thumb.is_not(None)))
        if since is not None:
            query = query.where(responses.c.created_at >= since)
        counts: dict[str, list[int]] = {}
        with self.engine.connect() as conn:
            for version, thumb in conn.execute(query):
                up_down = counts.setdefault(version, [0, 0])
                up_down[0 if thumb > 0 else 1] += 1
        return {v: (u, d) for v, (u, d) in counts.items()}

    def answers_by_version(self, since: float, versions: list[str]) -> dict[str, list[tuple[Any, str]]]:
        """(prompt, answer text) of every answer `versions` gave since `since`, per version: the
        prompt is the messages of a chat, the text of a completion."""
        query = (select(responses.c.model_version, responses.c.prompt_json, answers.c.text)
                 .join(answers, answers.c.response_id == responses.c.id)
                 .where((responses.c.created_at >= since) & responses.c.model_version.in_(versions)))
        out: dict[str, list[tuple[Any, str]]] = {v: [] for v in versions}
        with self.engine.connect() as conn:
            for version, prompt_json, text in conn.execute(query):
                out[version].append((json.loads(prompt_json), text))
        return out

    def version_served_before(self, version: str) -> str | None:
        """The version whose answer was served most recently among all but `version`: the one
        `version` replaced, where no deploy history says so (a Kubernetes rollout)."""
        query = (select(responses.c.model_version).where(responses.c.model_version != version)
                 .order_by(responses.c.created_at.desc()).limit(1))
        with self.engine.connect() as conn:
            return conn.execute(query).scalar()

    def last_export(self) -> dict | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(exports).order_by(exports.c.covered_until.desc()).limit(1)).first()
        return dict(row._mapping) if row is not None else None

    def record_export(self, *, covered_until: float, version: str, fingerprint: str, path: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(insert(exports).values(created_at=time.time(), covered_until=covered_until, version=version,
                                                fingerprint=fingerprint, path=path))

    def counts(self) -> dict[str, int]:
        """Rows per table."""
        with self.engine.connect() as conn:
            return {t.name: conn.execute(select(func.count()).select_from(t)).scalar_one()
                    for t in (responses, answers, ratings, choices)}
