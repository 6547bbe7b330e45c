"""The HTTP/1.1 protocol the API is served with: uvicorn's httptools protocol, with a bounded request head.

Where it sits: below all of our ASGI code. uvicorn (app/cli.py) gives each
connection's bytes to this protocol, which parses them into requests and
hands each one to the app, so it is the only place that sees a request
before its headers are complete. A head over MAX_HEAD_BYTES is answered 431,
one not complete within HEAD_TIMEOUT_SECONDS 408.
docs/reference/http-edge.md#the-requests-head-bounded-in-the-protocol
explains why httptools is kept and bounded here.
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
        self._in_head = False  # from a request's first byte to the end of its headers
        self._in_body = False  # from the end of a request's headers to the end of the request
        self._head_bytes = 0  # of the head being received, before this chunk
        self._tail = b""  # the last bytes of the head so far: its blank line may span two chunks
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()  # a connection that never sends anything is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._in_body and self._head_too_large(data):
            # Refused before the parser sees the chunk: httptools would buffer
            # it, and once the headers were complete the request would start.
            self._refuse(REQUEST_HEADER_TOO_LARGE, f"the request line and headers exceed {MAX_HEAD_BYTES} bytes")
            return
        super().data_received(data)

    def _head_too_large(self, data: bytes) -> bool:
        """Count the head bytes in `data` (up to the blank line that ends a head) against the cap.

        Between requests or inside a head, a chunk is head up to the first
        blank line, and body (or the next request) after it. A second head in
        the same chunk (a pipelining client) is not counted: it gets at most
        one read more.
        """
        window = self._tail + data
        end = window.find(b"\r\n\r\n")
        head = len(data) if end < 0 else max(0, end + 4 - len(self._tail))
        if self._head_bytes + head > MAX_HEAD_BYTES:
            return True
        self._head_bytes, self._tail = (0, b"") if end >= 0 else (self._head_bytes + head, window[-3:])
        return False

    def on_message_begin(self) -> None:
        self._in_head = True
        self._arm_head_timer()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head, self._in_body = False, True
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = asyncio.get_running_loop().call_later(HEAD_TIMEOUT_SECONDS, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if not self._in_head:
            if self.cycle is None:
                self.transport.close()  # connected and said nothing: nobody to answer
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()  # a pipelined request waits for the answer before it is cut off
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
