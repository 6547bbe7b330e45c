"""Who may see the console: whoever holds the operator token, and nobody else.

The token comes as `Authorization: Bearer <token>` (for curl and scripts) or
through the login form, which opens a server-side session
(app/console/sessions.py): the cookie holds only that session's random id,
HttpOnly (no script can read it), SameSite=Strict (no other site's page can
send it), Secure when the request came over TLS. Every comparison of the
token is of SHA-256 digests with `hmac.compare_digest`, which takes the same
time wherever the inputs differ, so the token cannot be guessed a character
at a time from response times.

A console POST is accepted only from the console's own pages
(`same_origin`): a page on another site cannot log an operator out, or in,
or post anything else the console may one day accept.

A client's API key is never accepted: it is not the operator token, and the
console does not look at the client table to authenticate anyone. The console
shows every client's payments; one client's credential must not open it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from urllib.parse import urlsplit

from pydantic import SecretStr

COOKIE = "console_session"


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


def is_operator_token(given: str | None, token: SecretStr) -> bool:
    """`given` is the operator token (compared in constant time)."""
    return given is not None and hmac.compare_digest(_digest(given), _digest(token.get_secret_value()))


def same_origin(method: str, headers: Mapping[str, str]) -> bool:
    """A request a browser sent from this service's own pages, or one no browser sent.

    The algorithm of Go's net/http CrossOriginProtection: a browser says
    where a request comes from in Sec-Fetch-Site (every current browser),
    else in Origin, which must then name the host the request was sent to.
    A request with neither is not from a browser (curl, a script), or from
    one too old to send them, whose SameSite=Strict cookie still stays off
    another site's request. "null" (a sandboxed or privacy-stripped page) is
    refused.
    """
    if method in ("GET", "HEAD", "OPTIONS"):
        return True
    site = headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")  # "none": typed into the address bar, a bookmark
    origin = headers.get("origin")
    if origin is None:
        return True
    return urlsplit(origin).netloc.lower() == headers.get("host", "").lower() != ""


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
