"""The replay shortcut: a retry of a finished payment, answered before the framework runs.

Where it sits on a request's path: it is the second of our code that every
request meets (an ASGI middleware around the routes, just inside the body
cap of app/api/body_limit.py), and it looks only at `POST /v1/payments`. A
retry of a payment that has finished is the request this service sees most
when things go wrong (clients retry when they are slow to hear back), and it
needs no decision: one read, then the stored response, byte for byte. So it
is answered here, with the same read and the same rules as the full path, at
well under half the CPU of going through FastAPI's routing, dependency
solving and SQLAlchemy (docs/reference/performance.md).

The rule that keeps it safe: the shortcut answers only when it is sure, and
hands everything else, untouched, to the full path.

    POST /v1/payments with a usable Authorization and Idempotency-Key,
    a JSON body that validates as a PaymentRequest, whose client has a
    finished key with the same fingerprint   -> the stored response (here)
    anything else: another route, a header missing or malformed, a body
    that is not a valid request, an unknown API key, a new key, a key in
    flight, parked or first used for another request -> the full path

"Sure" means the very checks the full path makes, by the same functions:
the API key is read from the header as HTTPBearer reads it, the key is parsed
by `parse_idempotency_key`, the body is parsed with `json.loads` and validated
by the same model as FastAPI does (so it yields the same fingerprint), and
`service.stored_response` decides. A request that would be refused (401, 400,
422) is never answered here, so the order of those refusals is the full
path's. The shortcut writes nothing. When it hands a request on, it leaves
its read behind (`deps.hand_over`), so a new payment still costs one read.
It counts each replay it answers (`payments_replays_total`, answered_by
shortcut) and logs nothing: a line per replay would cost a good part of
what the shortcut saves (docs/operations.md#what-watching-costs).

One answer is its own: when its read cannot reach the database, it answers
503 `service-unavailable` here. It runs outside Starlette's
ExceptionMiddleware (every `add_middleware` does), so an exception it let
through would meet only the outermost handler and, before this, left as a
500 `internal-error`: a bug's answer to an outage.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pydantic import ValidationError

from app.api.body_limit import MAX_BODY_BYTES
from app.api.deps import bearer_api_key, hand_over, look_up
from app.api.errors import retry_after_seconds, unavailable_response
from app.db.errors import database_unavailable
from app.api.routes import final_response
from app.idempotency.keys import InvalidIdempotencyKey, parse_idempotency_key
from app.observability import metrics
from app.payments.models import PaymentRequest
from app.machine.engine import Finished
from app.payments.service import fingerprint, stored_response

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PATH = "/v1/payments"
# A payment request is a few hundred bytes. A body of unknown length goes to
# the full path, so the shortcut never buffers much; one over MAX_BODY_BYTES
# (the body cap, the same constant) never gets here (app/api/body_limit.py),
# and the shortcut checks it again rather than rely on its position.


class ReplayShortcut:
    """ASGI middleware: answers a retry of a finished payment from its stored response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

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
            replay = await _stored_replay(scope, api_key, key, body) if len(body) == length else None
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


async def _stored_replay(scope: Scope, api_key: str, key: str, body: bytes) -> Finished | None:
    """The stored response if this is a retry of a finished payment; None otherwise."""
    try:
        # json.loads, then the model: what FastAPI does with a JSON body.
        request = PaymentRequest.model_validate(json.loads(body))
    except (ValueError, RecursionError, ValidationError):
        return None  # not a valid payment request: the full path says why
    lookup = await look_up(scope["app"].state.services, api_key, key)
    hand_over(scope, lookup)
    if lookup.caller is None or lookup.caller.row is None:
        return None
    return stored_response(lookup.caller.row, fingerprint(request))
