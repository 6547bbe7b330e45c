"""The HTTP/1.1 protocol the API is served with: uvicorn's httptools protocol, with bounded heads, bodies and peers.

Where it sits: below all of our ASGI code. uvicorn (app/cli.py) gives each
connection's bytes to this protocol, which parses them into requests and
hands each one to the app, so it is the only place that sees a connection
before its first request, and a request before its headers are complete or
while its body is on the way. A head over MAX_HEAD_BYTES is answered 431,
one not complete within HEAD_TIMEOUT_SECONDS 408, a body not complete within
BODY_TIMEOUT_SECONDS of its headers 408; a connection past
MAX_CONNECTIONS_PER_PEER from one peer 429, at once (`Bounds`). Each refusal
is counted (`payments_http_refused_total`).
docs/reference/http-edge.md#the-requests-head-bounded-in-the-protocol
explains why httptools is kept and bounded here, and
docs/reference/http-edge.md#the-body-deadline-and-the-connections-of-one-client
the body's deadline and the bound per peer.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from app.problems import REQUEST_HEADER_TOO_LARGE, REQUEST_TIMEOUT, TOO_MANY_CONNECTIONS, ProblemType

# Our clients send well under 1 KiB of headers (an API key, a key, a content
# type). 16 KiB is what most servers and proxies allow by default.
MAX_HEAD_BYTES = 16 * 1024
# Headers normally arrive in one packet; 10 s is generous on any network.
HEAD_TIMEOUT_SECONDS = 10.0

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Peer = ipaddress.IPv4Address | ipaddress.IPv6Network


@dataclass(frozen=True)
class Bounds:
    """The bounds that come from the settings (app/config.py: BODY_TIMEOUT_SECONDS,
    MAX_CONNECTIONS_PER_PEER, FORWARDED_ALLOW_IPS)."""

    body_timeout_seconds: float = 10.0
    max_connections_per_peer: int = 100
    trusted_proxies: tuple[str, ...] = ("127.0.0.1", "::1")  # addresses, networks, or "*"
    _trusted: tuple[Network, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        nets = tuple(ipaddress.ip_network(e) for e in self.trusted_proxies if e != "*")
        object.__setattr__(self, "_trusted", nets)

    def peer(self, client: tuple[str, int] | None) -> Peer | None:
        """Whom a connection from `client` counts against; None if it is not counted (a trusted proxy)."""
        if client is None or "*" in self.trusted_proxies:
            return None  # not an IP socket (no peer address), or every peer trusted
        try:
            address = ipaddress.ip_address(client[0])
        except ValueError:
            return None
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # ::ffff:192.0.2.1 is 192.0.2.1
        if any(address in net for net in self._trusted):
            return None
        if isinstance(address, ipaddress.IPv6Address):
            return ipaddress.IPv6Network((address, 64), strict=False)
        return address


# The connections each peer holds, per server (one per process in `payments
# api`; weakly keyed, so a server that is gone takes its counts with it).
_held: weakref.WeakKeyDictionary[ServerState, Counter[Peer]] = weakref.WeakKeyDictionary()


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a cap and a deadline on each request's head, a deadline on its
    body, and a cap on the connections one peer holds."""

    def __init__(self, *args: Any, bounds: Bounds | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bounds = bounds or Bounds()
        self._in_head = False  # from a request's first byte to the end of its headers
        self._in_body = False  # from the end of a request's headers to the end of the request
        self._head_bytes = 0  # of the head being received, before this chunk
        self._tail = b""  # the last bytes of the head so far: its blank line may span two chunks
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._peer: Peer | None = None  # counted against this peer while open

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        peer = self._bounds.peer(self.client)
        if peer is not None:
            held = _held.setdefault(self.server_state, Counter())
            if held[peer] >= self._bounds.max_connections_per_peer:
                self._refuse(
                    TOO_MANY_CONNECTIONS, "peer_connections",
                    f"your address already holds {self._bounds.max_connections_per_peer} connections to this server",
                )
                return
            held[peer] += 1
            self._peer = peer
        self._arm_head_timer()  # a connection that never sends anything is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_body_timer()
        if self._peer is not None:
            held = _held[self.server_state]
            held[self._peer] -= 1
            if not held[self._peer]:
                del held[self._peer]
            self._peer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._in_body and self._head_too_large(data):
            # Refused before the parser sees the chunk: httptools would buffer
            # it, and once the headers were complete the request would start.
            self._refuse(
                REQUEST_HEADER_TOO_LARGE, "head_too_large", f"the request line and headers exceed {MAX_HEAD_BYTES} bytes"
            )
            return
        super().data_received(data)
        # Armed only for a body that did not come with its headers: the
        # common request, whole in one packet, never sets a timer.
        if self._in_body and self._body_timer is None and not self.transport.is_closing():
            self._body_timer = asyncio.get_running_loop().call_later(
                self._bounds.body_timeout_seconds, self._body_timed_out
            )

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
        self._cancel_body_timer()
        super().on_message_complete()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = asyncio.get_running_loop().call_later(HEAD_TIMEOUT_SECONDS, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if not self._in_head:
            if self.cycle is None:
                _count("head_timeout")
                self.transport.close()  # connected and said nothing: nobody to answer
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()  # a pipelined request waits for the answer before it is cut off
            return
        self._refuse(REQUEST_TIMEOUT, "head_timeout", f"the request's headers did not arrive within {HEAD_TIMEOUT_SECONDS:g} s")

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or not self._in_body or cycle is None:
            return
        queued = any(queued is cycle for queued, _ in self.pipeline)
        if queued or (cycle.response_started and not cycle.response_complete):
            # Reading waits while an earlier request is answered (pipelining),
            # and an answer under way is let finish: look again later.
            self._body_timer = asyncio.get_running_loop().call_later(
                self._bounds.body_timeout_seconds, self._body_timed_out
            )
            return
        if cycle.response_complete:
            # Answered without the body (a 413, a 401 for an unsigned
            # notification); the server would read the rest for ever.
            _count("body_timeout")
            self.transport.close()
            return
        # The application waits for the body: it is told the client is gone,
        # and anything it still sends is dropped.
        cycle.disconnected = True
        cycle.message_event.set()
        self._refuse(
            REQUEST_TIMEOUT, "body_timeout",
            f"the request body did not arrive within {self._bounds.body_timeout_seconds:g} s of its headers",
        )

    def _refuse(self, problem: ProblemType, reason: str, detail: str) -> None:
        """Answer with a problem and close: the rest of this connection cannot be parsed."""
        self._cancel_head_timer()
        self._cancel_body_timer()
        _count(reason)
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


def _count(reason: str) -> None:
    # Imported here, on the rare path: the parent process of `payments api`
    # imports this module too (app/cli.py) and counts nothing itself.
    from app.observability import metrics

    metrics.counter(metrics.REFUSED, reason).inc()
