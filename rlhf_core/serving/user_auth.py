"""Who a gateway request's user is: an id the application in front of the gateway vouches for.

Every client of an application shares the gateway's API key, so the key says which application
calls, never which person. The application signs each user's id with the user-signing secret,
which it shares with the gateway, and sends:

    x-user-id: <id>                     1 to 256 printable ASCII characters, no spaces
    x-user-signature: <hex>             HMAC-SHA256 of the id under the secret
    x-user-expires: <unix time>         optional; then the HMAC is of "<id>\\n<unix time>"

`sign_user` makes these headers. An `x-user-id` without a signature, and a body's `user` field,
are claims, not identities: the gateway never records feedback or deletes data on them. The
admin key (another secret, `x-admin-key`) may delete any user's data.

`anonymous` is reserved: it is the one rater of unsigned feedback when the gateway accepts it,
and no signature names it, so no signed user can delete everyone's anonymous feedback.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

USER_HEADER = "x-user-id"
SIGNATURE_HEADER = "x-user-signature"
EXPIRES_HEADER = "x-user-expires"
ADMIN_HEADER = "x-admin-key"
ANONYMOUS = "anonymous"
USER_SECRET_FILE = "user_signing_secret"  # in the serving state dir, when no env var holds it
ADMIN_KEY_FILE = "admin_key"

_USER_ID = re.compile(r"[\x21-\x7e]{1,256}")
_EXPIRES = re.compile(r"[0-9]{1,12}")


class Unauthenticated(Exception):
    """No signed user where one is needed, or a signature that does not hold (401)."""


def sign_user(secret: str, user_id: str, expires: int | None = None) -> dict[str, str]:
    """The headers that make `user_id` the user of a gateway request: `x-user-id`,
    `x-user-signature` and, with `expires` (a unix time), `x-user-expires`."""
    if not _USER_ID.fullmatch(user_id) or user_id == ANONYMOUS:
        raise ValueError(f"a user id is 1 to 256 printable ASCII characters without spaces, not {ANONYMOUS!r}; "
                         f"got {user_id!r}")
    headers = {USER_HEADER: user_id}
    if expires is not None:
        headers[EXPIRES_HEADER] = str(int(expires))
    headers[SIGNATURE_HEADER] = _mac(secret, user_id, headers.get(EXPIRES_HEADER))
    return headers


def verified_user(secret: str, headers: Mapping[str, str], now: float) -> str | None:
    """The user id `headers` carry under a valid, unexpired signature; None when they carry no
    signature at all (an unsigned `x-user-id` names nobody). Raises `Unauthenticated` for a
    signature that does not hold."""
    signature = headers.get(SIGNATURE_HEADER)
    if signature is None:
        return None
    user_id, expires = headers.get(USER_HEADER, ""), headers.get(EXPIRES_HEADER)
    if not _USER_ID.fullmatch(user_id) or user_id == ANONYMOUS:
        raise Unauthenticated(f"{USER_HEADER}: a signed user id is 1 to 256 printable ASCII characters without "
                              f"spaces, and not {ANONYMOUS!r}")
    if expires is not None and not _EXPIRES.fullmatch(expires):
        raise Unauthenticated(f"{EXPIRES_HEADER}: must be a unix time in whole seconds")
    if not hmac.compare_digest(_mac(secret, user_id, expires).encode(), signature.strip().lower().encode()):
        raise Unauthenticated(f"{SIGNATURE_HEADER}: does not match {USER_HEADER} under the user-signing secret")
    if expires is not None and now > int(expires):
        raise Unauthenticated(f"{SIGNATURE_HEADER}: expired at {expires}; sign the user id again")
    return user_id


def _mac(secret: str, user_id: str, expires: str | None) -> str:
    message = user_id if expires is None else f"{user_id}\n{expires}"
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()


def _same_secret(given: str, expected: str) -> bool:
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), hashlib.sha256(expected.encode()).digest())


@dataclass(frozen=True)
class UserAuth:
    """The gateway's rules on users: who rates, who asked, who may delete whose data."""

    secret: str
    admin_key: str | None = None
    anonymous_ratings: bool = False  # unsigned feedback: recorded as ANONYMOUS, else refused
    clock: Callable[[], float] = field(default=time.time, repr=False)

    def rater(self, headers: Mapping[str, str]) -> str:
        """The signed user of a feedback request; ANONYMOUS for unsigned feedback when that is
        accepted. Raises `Unauthenticated`."""
        if (user := verified_user(self.secret, headers, self.clock())) is not None:
            return user
        if self.anonymous_ratings:
            return ANONYMOUS
        raise Unauthenticated(
            f"feedback needs a signed user: send {USER_HEADER} with {SIGNATURE_HEADER} (HMAC-SHA256 of the id under "
            f"the user-signing secret); an unsigned {USER_HEADER} or a body's user field is not trusted")

    def asker(self, headers: Mapping[str, str]) -> str:
        """The signed user of a completion request, else ANONYMOUS (serving needs no user).
        Raises `Unauthenticated` for a signature that does not hold."""
        return verified_user(self.secret, headers, self.clock()) or ANONYMOUS

    def may_delete(self, headers: Mapping[str, str], user_id: str) -> bool:
        """The admin key, or `user_id`'s own valid signature."""
        if self.admin_key and (given := headers.get(ADMIN_HEADER)) is not None:
            return _same_secret(given, self.admin_key)
        try:
            return verified_user(self.secret, headers, self.clock()) == user_id
        except Unauthenticated:
            return False


def resolve_secret(env_name: str, path: Path) -> str:
    """$<env_name> if set and non-empty; else the secret in `path`, generated (mode 0600) on
    first use: the way the serving API key is resolved."""
    from rlhf_core.serving.auth import secret_file  # noqa: PLC0415 - keeps this module free of the config

    return os.environ.get(env_name, "") or secret_file(Path(path))


def user_auth_for(feedback_cfg, state_dir: Path) -> UserAuth:
    """The `UserAuth` of a gateway: the user-signing secret and admin key of `feedback_cfg`
    (`user_secret_env`, `admin_key_env`), else their files in the serving state dir."""
    return UserAuth(secret=resolve_secret(feedback_cfg.user_secret_env, Path(state_dir) / USER_SECRET_FILE),
                    admin_key=resolve_secret(feedback_cfg.admin_key_env, Path(state_dir) / ADMIN_KEY_FILE),
                    anonymous_ratings=feedback_cfg.unsigned_ratings == "anonymous")
