"""The replay shortcut: a retry of a finished payment, answered before FastAPI runs.

Where it sits on a request's path: an ASGI middleware just inside the body
cap (app/api/body_limit.py), looking only at `POST /v1/payments`. It answers
only when it is sure, with the full path's own checks and decision, and hands
everything else on untouched, with its read (what the full path would read
next) handed over. Why it is safe, and what it answers itself:
docs/request-path.md#the-replay-shortcut-a-measured-optimisation.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import ValidationError

from app.api import deps
from app.api.body_limit import MAX_BODY_BYTES
from app.api.errors import retry_after_seconds, unavailable_response
from app.api.routes import final_response
from app.db.errors import database_unavailable
from app.fastpath.lookup_pool import LookupPool
from app.idempotency.keys import InvalidIdempotencyKey, parse_idempotency_key
from app.observability import metrics
from app.payments.models import PaymentRequest
from app.machine.engine import Finished
from app.payments.submission import fingerprint, stored_response

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PATH = "/v1/payments"


def install(app: FastAPI, lookups: LookupPool) -> None:
    """Put the shortcut in front of `app`'s routes; the read it makes is left for the full path (deps.HANDED_OVER)."""
    app.add_middleware(ReplayShortcut, lookups=lookups)


class ReplayShortcut:
    """ASGI middleware: answers a retry of a finished payment from its stored response."""

    def __init__(self, app: ASGIApp, lookups: LookupPool) -> None:
        self.app = app
        self.lookups = lookups

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != PATH:
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        if headers is None:
            await self.app(scope, receive, send)
            return
        api_key, key, length = headers
        messages = await _read_body(receive, length)
        body = b"".join(m.get("body", b"") for m in messages)
        try:
            replay = await self._stored_replay(scope, api_key, key, body) if len(body) == length else None
        except Exception as exc:
            if not database_unavailable(exc):
                raise
            retry_after = retry_after_seconds(scope["app"])
            await unavailable_response(PATH, exc, retry_after)(scope, receive, send)
            return
        if replay is not None:
            metrics.REPLAYED_BY_SHORTCUT.inc()
            await final_response(replay, replayed=True)(scope, receive, send)
            return
        await self.app(scope, _replaying(messages, receive), send)

    async def _stored_replay(self, scope: Scope, api_key: str, key: str, body: bytes) -> Finished | None:
        """The stored response if this is a retry of a finished payment; None otherwise."""
        try:
            # json.loads, then the model: what FastAPI does with a JSON body.
            request = PaymentRequest.model_validate(json.loads(body))
        except (ValueError, RecursionError, ValidationError):
            return None  # not a valid payment request: the full path says why
        lookup = await self.lookups.look_up(api_key, key)
        scope.setdefault("state", {})[deps.HANDED_OVER] = lookup
        if lookup.caller is None or lookup.caller.row is None:
            return None
        return stored_response(lookup.caller.row, fingerprint(request))


def _headers(scope: Scope) -> tuple[str, str, int] | None:
    """(API key, Idempotency-Key, body length), if all three are usable and unambiguous."""
    seen: dict[bytes, str] = {}
    for name, value in scope["headers"]:
        if name in (b"authorization", b"idempotency-key", b"content-length", b"content-type"):
            if name in seen:
                return None  # sent twice: leave it to the full path
            seen[name] = value.decode("latin-1")  # as Starlette decodes header values
    # FastAPI parses a body as JSON only under a JSON content type; so does this.
    if seen.get(b"content-type", "").split(";")[0].strip().lower() != "application/json":
        return None
    api_key = bearer_api_key(seen.get(b"authorization"))
    raw_key, length = seen.get(b"idempotency-key"), seen.get(b"content-length", "")
    # A body of unknown length goes to the full path, so the shortcut never
    # buffers much; the body cap refuses one over MAX_BODY_BYTES before it
    # gets here, and the shortcut checks again rather than rely on its place.
    if api_key is None or raw_key is None or not length.isdigit() or int(length) > MAX_BODY_BYTES:
        return None
    try:
        key = parse_idempotency_key(raw_key)
    except InvalidIdempotencyKey:
        return None
    return api_key, key, int(length)


async def _read_body(receive: Receive, length: int) -> list[Message]:
    """The messages that carry the body (at most `length` bytes of it), as received."""
    messages: list[Message] = []
    received = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages  # the client went away: the full path will notice too
        received += len(message.get("body", b""))
        if not message.get("more_body", False) or received > length:
            return messages


def _replaying(messages: list[Message], receive: Receive) -> Receive:
    """A `receive` that gives the full path the messages already read, then the rest."""
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay


def bearer_api_key(authorization: str | None) -> str | None:
    """The API key in an `Authorization` header's value, or None: as the full path reads it.

    Parsed by the function FastAPI's HTTPBearer uses (the scheme "Bearer" in
    any case, the key after the first space, stripped), and held to the same
    bounds (`deps.usable_api_key`).
    """
    scheme, api_key = get_authorization_scheme_param(authorization)
    return deps.usable_api_key(api_key) if scheme.lower() == "bearer" else None
