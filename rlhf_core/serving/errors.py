"""The one error every part of serving raises: its message says what failed and why."""
from __future__ import annotations


class ServingError(RuntimeError):
    """A deployment (or a request to a deployed server) that failed; the message says why."""
