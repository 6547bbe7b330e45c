"""The body cap: a request body over MAX_BODY_BYTES is refused (413) before anything reads it.

Where it sits: an ASGI middleware inside the request metrics and the
in-flight tracking, outside the replay shortcut and FastAPI (app/main.py),
so a body over the cap is refused before it is parsed or anyone is
authenticated. A declared Content-Length is checked at once; a chunked body
is counted as it arrives. docs/reference/http-edge.md#the-body-capped-before-anything-reads-it
explains why, and why the connection is left open (until BODY_TIMEOUT_SECONDS
after the headers: app/api/http_protocol.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from app.api.errors import problem_response
from app.problems import PAYLOAD_TOO_LARGE

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# A payment request is a few hundred bytes and well under 4 KiB with the
# longest name and reference the schema allows; 16 KiB leaves room for
# whitespace and still bounds what one request can make us hold.
MAX_BODY_BYTES = 16 * 1024


class BodyLimit:
    """ASGI middleware: 413 for a body over `max_bytes`, declared or counted."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES, per_path: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        # A route whose body is a file (a payment batch) has a cap of its own.
        self.per_path = per_path or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.per_path.get(scope.get("path", ""), self.max_bytes)
        declared = _content_length(scope)
        if declared is not None:
            if declared > max_bytes:
                await self._refuse(scope, receive, send, max_bytes)
            else:
                # The server delivers exactly Content-Length bytes (more would
                # be the next request's), so there is nothing to count: the
                # common case costs no wrapping at all.
                await self.app(scope, receive, send)
            return

        received = 0
        started = refused = False

        async def counted() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    refused = True
                    if not started:
                        await self._refuse(scope, receive, send, max_bytes)
                    # To the app, the client is gone: it stops reading, and
                    # whatever it answers is dropped (below).
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 was the answer
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted, guarded)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, max_bytes: int) -> None:
        what = "a payment is well under 4 KiB" if max_bytes == self.max_bytes else "this route's cap"
        response = problem_response(
            PAYLOAD_TOO_LARGE,
            f"the request body is larger than {max_bytes} bytes; {what}",
            instance=scope.get("path"),
        )
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    """The declared body length; None if there is none (a chunked body).

    A value that is not a number counts as none: the body is then counted
    as it arrives, so the cap holds either way.
    """
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None
