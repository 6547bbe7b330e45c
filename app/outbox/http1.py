"""The webhook dispatcher's HTTP client: one POST at a time on a kept-alive HTTP/1.1 connection, nothing more.

Where it sits: under app/outbox/delivery.py::post, after the commit, off
every request's path; the dispatcher in `payments worker` is its only user.
An optimisation, named as one: aiohttp's client, which did this job before,
builds a request object, a response object, a timer, a header dictionary and
a stream for every POST, for features a webhook never uses; this client
writes the request as one buffer and reads the answer with `httptools` (the
C parser uvicorn uses), and spends a fraction of the instructions per POST
(docs/reference/performance.md#a-webhook-post-without-aiohttp).

What it does: a POST with a body and headers the caller gives; the answer's
status and Retry-After; the answer's body read to its end when it is short
and sized, so that its connection carries the next webhook; connections
kept per (scheme, host, port), at most `max_connections` open, an idle one
closed after KEEP_ALIVE_SECONDS; https with the egress policy's trust.
Where it connects is the policy's: every address a name resolves to is
judged before a socket is made (egress.permitted), at every connection.

What it does not do, on purpose: follow redirects (a moved endpoint is
registered again), send cookies, use a proxy, decompress, speak HTTP/2, or
send a request twice (a connection that breaks is an error of this attempt;
the dispatcher's schedule sends the webhook again, at least once).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

import httptools

from app.outbox import egress

# A second shorter than the 5 s idle timeout of common servers (uvicorn's;
# nginx's is longer): a connection the merchant is about to close is not
# picked for a POST, which is never sent twice, and would count as failed.
# (Equal to it, a POST now and then met the server's close: its events
# waited for their retries.) A server that closes sooner is seen to have
# closed, but for the moment it does.
KEEP_ALIVE_SECONDS = 4.0
# The URLs whose parse is kept (`Client.targets`): one per endpoint in use;
# past this many (endpoints re-registered over a long life), all are parsed anew.
TARGETS_KEPT = 1024

Resolve = Callable[[str, int], Awaitable[list[tuple]]]


class NotHttp(ValueError):
    """The other end answered something that is not an HTTP/1.x response."""


class HungUp(ConnectionError):
    """The connection closed before the answer's head arrived."""


@dataclass(frozen=True)
class Head:
    """The head of an answer: what a webhook's outcome is read from."""

    status: int
    retry_after: str | None


@dataclass(frozen=True)
class _Target:
    """A URL as a connection and a request line need it; parsed once per URL (`_target`)."""

    tls: bool
    host: str  # as the socket layer takes it: no brackets around an IPv6 literal
    port: int
    path: bytes  # the request target: path and query
    authority: bytes  # the Host header


def _target(url: str) -> _Target:
    """ValueError for anything that is not an absolute http(s) URL with a host and a valid port."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an absolute http or https URL: {url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)  # .port raises ValueError for one out of range
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    # Characters a request line cannot carry are percent-encoded; what is encoded already stays as it is.
    path = quote(path, safe="!#$%&'()*+,/:;=?@[]~")
    return _Target(tls, parts.hostname, port, path.encode("ascii"), parts.netloc.rpartition("@")[2].encode("idna"))


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection to an endpoint, and the parser of the answers that come back on it.

    One exchange at a time: `send` writes a request, `head` resolves with the
    answer's status and Retry-After, `finished` when its body has ended.
    The httptools callbacks (`on_*`) fill them in.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.head: asyncio.Future[Head] | None = None
        self.finished: asyncio.Future[None] | None = None
        self.retry_after: str | None = None
        self.length: int | None = None  # the answer's Content-Length, if it has one
        self.open = True
        self.keep_alive = False  # the last answer allows another request on this connection
        self.idle_since = 0.0

    # -- asyncio's side --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(NotHttp(f"the answer is not HTTP/1.x ({exc})"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._fail(exc or HungUp("the connection was closed before the answer ended"))

    # -- the parser's side -----------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"retry-after":
            self.retry_after = value.decode("latin-1").strip()
        elif name == b"content-length":
            self.length = int(value)  # httptools has refused one that is not a number

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            return  # an interim answer (100 Continue, 103): the real one follows
        if self.head is not None and not self.head.done():
            self.head.set_result(Head(status, self.retry_after))

    def on_message_complete(self) -> None:
        if self.finished is not None and not self.finished.done() and self.head is not None and self.head.done():
            # Asked now: the parser knows only while the message is its current one.
            self.keep_alive = self.parser.should_keep_alive()
            self.finished.set_result(None)

    # -- the exchange ----------------------------------------------------------

    def send(self, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        self.head, self.finished = loop.create_future(), loop.create_future()
        self.retry_after = self.length = None
        self.keep_alive = False
        assert self.transport is not None
        self.transport.write(request)

    def worth_reading(self, most: int) -> bool:
        """Whether to wait for the answer's body: only a short one of a stated length.

        A merchant's framework often sends the body a moment after the head
        (uvicorn does): read to its end, the connection carries the next
        webhook. A body without a length, or longer than `most`, is not
        waited for (a receiver must not make us read megabytes), and its
        connection is closed.
        """
        return self.length is not None and self.length <= most

    def reusable(self) -> bool:
        """Whether the last exchange ended cleanly and the connection may carry the next one."""
        return (self.open and self.finished is not None and self.finished.done()
                and self.finished.exception() is None and self.keep_alive)

    def close(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.close()

    def _fail(self, exc: Exception) -> None:
        for waiter in (self.head, self.finished):
            if waiter is not None and not waiter.done():
                waiter.set_exception(exc)
                waiter.exception()  # retrieved: `finished` is not awaited when the head already failed


class Client:
    """Kept-alive connections per endpoint, at most `max_connections` open; use as `async with`."""

    def __init__(self, *, max_connections: int, policy: egress.EgressPolicy, max_body_read: int,
                 resolve: Resolve | None = None) -> None:
        self.policy = policy
        self.max_body_read = max_body_read
        self.slots = asyncio.Semaphore(max_connections)
        self.idle: dict[tuple[bool, str, int], list[_Connection]] = {}
        self.sweep: asyncio.TimerHandle | None = None  # the next close of connections idle too long
        self.targets: dict[str, _Target] = {}
        self.resolve = resolve or _resolve
        self.tls = policy.ssl_context()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self.sweep is not None:
            self.sweep.cancel()
        for connections in self.idle.values():
            for connection in connections:
                connection.close()
        self.idle.clear()

    async def post(self, url: str, body: bytes, headers: dict[str, str], timeout: float) -> Head:
        """POST `body` to `url` within `timeout` seconds in all, connecting included; the answer's head.

        Raises, and nothing else: TimeoutError when no head came in time;
        ValueError for a URL that cannot be posted to (NotHttp: an answer
        that is not HTTP); egress.RefusedAddress for an endpoint the policy
        refuses; ssl.SSLError for a TLS failure; OSError for any other
        failure to connect, or a connection that broke before the head.
        Once the head is in, its status stands: a body that stalls or
        breaks only costs the connection.
        """
        target = self.targets.get(url)
        if target is None:
            if len(self.targets) >= TARGETS_KEPT:
                self.targets.clear()
            target = self.targets[url] = _target(url)
        async with self.slots:
            connection, head = None, None
            try:
                async with asyncio.timeout(timeout):
                    connection = self._idle(target) or await self._connect(target)
                    connection.send(self._request(target, body, headers))
                    head = await connection.head  # type: ignore[misc]
                    if connection.worth_reading(self.max_body_read):
                        await connection.finished  # type: ignore[misc]
            except BaseException as exc:
                if connection is not None:
                    connection.close()  # never reused after an exchange that did not end cleanly
                if head is not None and isinstance(exc, TimeoutError | OSError | ValueError):
                    return head
                raise
            if connection.reusable():
                connection.idle_since = time.monotonic()
                self.idle.setdefault((target.tls, target.host, target.port), []).append(connection)
                if self.sweep is None:
                    self.sweep = asyncio.get_running_loop().call_later(KEEP_ALIVE_SECONDS, self._sweep)
            else:
                connection.close()
            return head

    def _request(self, target: _Target, body: bytes, headers: dict[str, str]) -> bytes:
        lines = [b"POST ", target.path, b" HTTP/1.1\r\nhost: ", target.authority,
                 b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:
                raise ValueError(f"a line break in the {name} header")
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines.append(b"\r\n")
        lines.append(body)
        return b"".join(lines)

    def _sweep(self) -> None:
        """Close every connection idle too long, to any endpoint: one no webhook goes to any more holds nothing.

        Runs KEEP_ALIVE_SECONDS after a connection was last put back with no
        sweep pending, and again while any connection is idle.
        """
        self.sweep = None
        now = time.monotonic()
        for key in list(self.idle):
            kept = []
            for connection in self.idle[key]:
                if connection.open and now - connection.idle_since < KEEP_ALIVE_SECONDS:
                    kept.append(connection)
                else:
                    connection.close()
            if kept:
                self.idle[key] = kept
            else:
                del self.idle[key]
        if self.idle:
            self.sweep = asyncio.get_running_loop().call_later(KEEP_ALIVE_SECONDS, self._sweep)

    def _idle(self, target: _Target) -> _Connection | None:
        """The most recently used idle connection to the endpoint still fit to carry a request, if any."""
        idle = self.idle.get((target.tls, target.host, target.port))
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if connection.open and now - connection.idle_since < KEEP_ALIVE_SECONDS:
                return connection
            connection.close()
        return None

    async def _connect(self, target: _Target) -> _Connection:
        """A new connection to one of the addresses the policy permits, tried in the resolver's order."""
        loop = asyncio.get_running_loop()
        found = await self.resolve(target.host, target.port)
        permitted = egress.permitted(self.policy, found)
        failure: OSError | None = None
        for family, type_, proto, _, address in permitted:
            sock = socket.socket(family, type_, proto)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_connect(sock, address)
            except OSError as exc:
                sock.close()
                failure = exc
                continue
            except BaseException:
                sock.close()
                raise
            _, connection = await loop.create_connection(
                _Connection, sock=sock, ssl=self.tls if target.tls else None,
                server_hostname=target.host if target.tls else None,
            )
            return connection
        assert failure is not None  # egress.permitted raised if nothing was permitted
        raise failure


async def _resolve(host: str, port: int) -> list[tuple]:
    """The addresses `host` is now (an address spells itself), as getaddrinfo gives them."""
    try:
        return await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except UnicodeError as exc:  # a name IDNA cannot encode
        raise ValueError(f"not a host name: {host!r}") from exc
