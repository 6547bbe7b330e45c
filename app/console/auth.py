"""Who may see the console: whoever holds the operator token, and nobody else.

The token comes as `Authorization: Bearer <token>` (for curl and scripts) or
as a cookie set by the login form: an HttpOnly (no script can read it),
SameSite=Strict (no other site's page can send it) cookie holding an HMAC of
the token rather than the token itself, so the cookie is worthless once the
token changes. Every comparison is of SHA-256 digests with
`hmac.compare_digest`, which takes the same time wherever the inputs differ,
so the token cannot be guessed a character at a time from response times.

A client's API key is never accepted: it is not the operator token, and the
console does not look at the client table to authenticate anyone. The console
shows every client's payments; one client's credential must not open it.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import urlsplit

from pydantic import SecretStr

COOKIE = "console_session"
# How long the login cookie lasts: one working day of on-call, then log in again.
COOKIE_MAX_AGE_SECONDS = 12 * 3600
_SESSION_CONTEXT = b"exactly-once-payments operator console session v1"


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


def is_operator_token(given: str | None, token: SecretStr) -> bool:
    """`given` is the operator token (compared in constant time)."""
    return given is not None and hmac.compare_digest(_digest(given), _digest(token.get_secret_value()))


def session_value(token: SecretStr) -> str:
    """The login cookie's value: an HMAC of a fixed context under the token."""
    return hmac.new(token.get_secret_value().encode(), _SESSION_CONTEXT, hashlib.sha256).hexdigest()


def is_session(given: str | None, token: SecretStr) -> bool:
    return given is not None and hmac.compare_digest(_digest(given), _digest(session_value(token)))


def bearer(authorization: str | None) -> str | None:
    scheme, _, credentials = (authorization or "").partition(" ")
    return credentials.strip() or None if scheme.lower() == "bearer" else None


def safe_next(target: str | None) -> str:
    """Where to go after logging in: a console page of this service, never another site."""
    if not target:
        return "/console"
    parts = urlsplit(target)
    # Only a path (no scheme, no host, not "//evil.example"), and only the console's.
    if parts.scheme or parts.netloc or not (target == "/console" or target.startswith("/console/")) or "\\" in target:
        return "/console"
    return target
