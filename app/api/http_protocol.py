"""The HTTP/1.1 protocol the API is served with: uvicorn's httptools protocol, with a bounded request head.

Where it sits: below all of our ASGI code. uvicorn gives each connection's
bytes to this protocol; it parses them into requests and hands each one to
the app (the body cap, the replay shortcut, FastAPI). So this is the only
place that sees a request before its headers are complete, and the only
place that can bound them.

uvicorn parses HTTP with httptools when it is installed (it is, through
`uvicorn[standard]`), and httptools keeps a header however long it is: a
single 50 MB header was read into memory and answered 200. h11, uvicorn's
other parser, is bounded (`h11_max_incomplete_event_size`) but costs more
CPU per request than httptools, on every request. And neither parser has a
deadline: a client that opens a connection and sends its headers a byte at a
time (or nothing at all) holds the connection and its memory for as long as
it likes. So httptools is kept and two bounds are added around it:

* the request line and headers together may be at most MAX_HEAD_BYTES; past
  that the request is answered 431 `request-header-too-large` and the
  connection closed;
* they must arrive within HEAD_TIMEOUT_SECONDS of the connection opening or
  of the request's first byte; past that the request is answered 408
  `request-timeout` (or, if nothing at all was sent, the connection is just
  closed).

The body is bounded by app/api/body_limit.py; idle keep-alive connections by
uvicorn's `timeout_keep_alive`; the number of connections by
`limit_concurrency` (app/cli.py). The subclass uses the callbacks httptools
calls on uvicorn's protocol (`on_headers_complete`, `on_message_complete`),
which are pinned with uvicorn; tests/integration/test_payments_api.py checks
both bounds against the real server.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.problems import REQUEST_HEADER_TOO_LARGE, REQUEST_TIMEOUT, ProblemType

# Our clients send well under 1 KiB of headers (an API key, a key, a content
# type). 16 KiB is what most servers and proxies allow by default.
MAX_HEAD_BYTES = 16 * 1024
# Headers normally arrive in one packet; 10 s is generous on any network.
HEAD_TIMEOUT_SECONDS = 10.0


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a size cap and a deadline on each request's head."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading_head = True  # between a request's end (or the connection's start) and its headers' end
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()  # a connection that never sends anything is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._reading_head and self._head_timer is None:
            self._arm_head_timer()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self._reading_head and not self.transport.is_closing():
            # Still no end of headers after this chunk: all of it was head.
            # (httptools has buffered it; this is what bounds that buffer.)
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(REQUEST_HEADER_TOO_LARGE, f"the request line and headers exceed {MAX_HEAD_BYTES} bytes")

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_head, self._head_bytes = True, 0

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = asyncio.get_running_loop().call_later(HEAD_TIMEOUT_SECONDS, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._reading_head or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()  # a pipelined request waits for the one before it: not slow
            return
        if self._head_bytes == 0 and self.cycle is None:
            self.transport.close()  # connected and said nothing: nobody to answer
            return
        self._refuse(REQUEST_TIMEOUT, f"the request's headers did not arrive within {HEAD_TIMEOUT_SECONDS:g} s")

    def _refuse(self, problem: ProblemType, detail: str) -> None:
        """Answer with a problem and close: the rest of this connection cannot be parsed."""
        self._cancel_head_timer()
        body = json.dumps(
            {"type": problem.uri, "title": problem.title, "status": problem.status, "detail": detail}
        ).encode()
        self.transport.write(
            f"HTTP/1.1 {problem.status} {problem.title}\r\n".encode()
            + b"content-type: application/problem+json\r\n"
            + f"content-length: {len(body)}\r\n".encode()
            + b"connection: close\r\n\r\n"
            + body
        )
        self.transport.close()
