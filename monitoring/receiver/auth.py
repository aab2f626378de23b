"""The bearer token Alertmanager must present: loaded once at startup, refused if weak."""
from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Mapping

log = logging.getLogger("rlhf.receiver")

TOKEN_ENV = "RLHF_RECEIVER_TOKEN"
MIN_TOKEN_CHARS = 16


class TokenError(ValueError):
    """No usable bearer token: the receiver does not start."""


def check_token(token: str, source: str) -> str:
    if not token:
        raise TokenError(f"{source}: the token is empty")
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenError(f"{source}: the token has {len(token)} characters, at least {MIN_TOKEN_CHARS} are needed")
    if not all("!" <= c <= "~" for c in token):
        raise TokenError(f"{source}: the token must be printable ASCII without spaces (it goes in an HTTP header)")
    return token


def load_token(token_file: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> str:
    """The bearer token from `token_file` (stripped, as Alertmanager's credentials_file is)
    or else from $RLHF_RECEIVER_TOKEN. Raises TokenError if there is none or it is weak."""
    env = os.environ if env is None else env
    if token_file is not None:
        path = Path(token_file)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenError(f"token file {path}: cannot read it ({exc})") from None
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning(json.dumps({"event": "startup",
                                    "warning": f"token file {path} is readable by others; chmod 600"}))
        return check_token(text.strip(), f"token file {path}")
    if env.get(TOKEN_ENV) is not None:
        return check_token(env[TOKEN_ENV].strip(), f"${TOKEN_ENV}")
    raise TokenError(f"no token: pass --token-file or set ${TOKEN_ENV}")
