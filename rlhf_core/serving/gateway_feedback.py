"""The body of `POST /v1/feedback`, checked field by field."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_core.serving.user_auth import ANONYMOUS, USER_HEADER

FEEDBACK_FIELDS = {"response_id", "rating", "score", "comment", "choice_index", "preferred", "user"}
MAX_COMMENT = 4000


class BadRequest(Exception):
    def __init__(self, field_name: str, message: str, status: int = 400):
        super().__init__(f"{field_name}: {message}")
        self.field, self.status = field_name, status


@dataclass
class FeedbackRequest:
    response_id: str
    user: str
    choice_index: int = 0
    thumb: int | None = None
    score: float | None = None
    comment: str | None = None
    preferred: int | None = None


def parse_feedback(body: Any, rater: str) -> FeedbackRequest:
    """A feedback body checked field by field; `BadRequest` names the first field at fault.

    `rater` is the request's signed user (or ANONYMOUS): the body's `user`, OpenAI's field,
    names nobody. It may repeat the signed user, and is ignored on anonymous feedback."""
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    if unknown := sorted(set(body) - FEEDBACK_FIELDS):
        raise BadRequest(unknown[0], f"unknown field; expected some of {sorted(FEEDBACK_FIELDS)}")
    rid = body.get("response_id")
    if not isinstance(rid, str) or not rid:
        raise BadRequest("response_id", "required: the id of the response being rated (a string)")
    claimed = body.get("user")
    if claimed is not None and rater != ANONYMOUS and claimed != rater:
        raise BadRequest("user", f"differs from the signed {USER_HEADER}: the signed user is the rater")
    fb = FeedbackRequest(rid, rater)
    rating, score, preferred = body.get("rating"), body.get("score"), body.get("preferred")
    if rating is not None:
        if rating not in ("up", "down"):
            raise BadRequest("rating", f'must be "up" or "down", got {rating!r}')
        fb.thumb = 1 if rating == "up" else -1
    if score is not None:
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not -1e6 < score < 1e6:
            raise BadRequest("score", f"must be a number, got {score!r}")
        fb.score = float(score)
    if preferred is not None:
        if isinstance(preferred, bool) or not isinstance(preferred, int):
            raise BadRequest("preferred", f"must be the index of the preferred answer, got {preferred!r}")
        if rating is not None or score is not None:
            raise BadRequest("preferred", "a choice between answers cannot also carry a rating or a score")
        fb.preferred = preferred
    if rating is None and score is None and preferred is None:
        raise BadRequest("rating", 'one of "rating", "score" or "preferred" is required')
    choice = body.get("choice_index", 0)
    if isinstance(choice, bool) or not isinstance(choice, int):
        raise BadRequest("choice_index", f"must be an integer, got {choice!r}")
    fb.choice_index = choice
    comment = body.get("comment")
    if comment is not None and (not isinstance(comment, str) or len(comment) > MAX_COMMENT):
        raise BadRequest("comment", f"must be a string of at most {MAX_COMMENT} characters")
    fb.comment = comment
    return fb
