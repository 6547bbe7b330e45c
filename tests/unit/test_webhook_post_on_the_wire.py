"""What one webhook POST comes to (app/outbox/delivery.py::post), over real sockets.

Each test starts a tiny loopback server that answers the way a merchant, a
proxy or a broken network might, and POSTs to it with the session the
dispatcher uses (`delivery.session`, app/outbox/http1.py). The `Answer` is what gets
recorded and what `decide` reads: a 2xx is delivered, any other status is an
`http_status` (429: `rate_limited`) with its Retry-After, and an exchange
without an HTTP answer is a `timeout` or a `connection` error, never an
exception out of `post`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import pytest
import uvicorn
from standardwebhooks import Webhook

from app.outbox import delivery, egress, http1
from app.outbox.delivery import Claimed
from app.outbox.endpoints import new_secret
from tests.support import until

SECRET = new_secret()


class Merchant:
    """A loopback server answering every request with `raw` (bytes; "close": hang up; "hang": never answer)."""

    def __init__(self, raw: bytes | str) -> None:
        self.raw = raw
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body)
        self.connections = 0

    async def read_request(self, reader: asyncio.StreamReader) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length")), 0)
        self.requests.append((head, await reader.readexactly(length)))

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                await self.read_request(reader)
                if self.raw == "close":
                    return
                if self.raw == "hang":
                    await asyncio.Event().wait()  # cancelled when the server closes
                writer.write(self.raw)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
def endpoint(serve) -> Callable[[Merchant], Awaitable[str]]:
    """A merchant's webhook URL on a loopback server of its own (the `serve` fixture)."""
    async def start(merchant: Merchant) -> str:
        return await serve(merchant) + "/webhooks"

    return start


@pytest.fixture
async def session():
    # The merchants here are on loopback: the development policy lets the dispatcher reach them.
    async with delivery.session(max_connections=4, policy=egress.development()) as http:
        yield http


def claimed(url: str) -> Claimed:
    return Claimed(
        event_id=uuid.uuid4(), client_id=1, attempt=1, due_attempt=1, lease_token=uuid.uuid4(), url=url,
        secret=SECRET, type="payment.succeeded", data='{"id":"p","status":"succeeded"}',
        created_at=datetime(2026, 12, 2, tzinfo=UTC),
    )


def answer(status: int, extra: str = "", body: bytes = b"") -> bytes:
    return f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


async def test_a_2xx_is_delivered_with_the_signed_body_and_headers_on_the_wire(endpoint, session):
    merchant = Merchant(answer(204))
    delivered = claimed(await endpoint(merchant))

    got = await delivery.post(session, delivered, timeout=2)

    assert (got.status_code, got.error_class) == (204, None) and got.latency_ms > 0
    [(head, body)] = merchant.requests
    assert body == delivered.body().encode()
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /webhooks HTTP/1.1"
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if line)}
    assert headers["content-type"] == "application/json"
    assert headers["user-agent"] == delivery.USER_AGENT
    assert headers["webhook-id"] == str(delivered.event_id)
    assert Webhook(SECRET).verify(body, headers)["data"] == json.loads(delivered.data)


async def test_the_connection_is_kept_alive_for_the_next_webhook(endpoint, session):
    merchant = Merchant(answer(200, body=b"{}"))
    url = await endpoint(merchant)

    for _ in range(3):
        assert (await delivery.post(session, claimed(url), timeout=2)).error_class is None

    assert (len(merchant.requests), merchant.connections) == (3, 1)


@pytest.mark.parametrize("status, error_class", [(500, "http_status"), (404, "http_status"), (401, "http_status"),
                                                 (429, "rate_limited")])
async def test_any_other_status_is_an_error_with_its_status(endpoint, session, status, error_class):
    got = await delivery.post(session, claimed(await endpoint(Merchant(answer(status)))), timeout=2)
    assert (got.status_code, got.error_class, got.error) == (status, error_class, f"HTTP {status}")


async def test_a_redirect_is_not_followed(endpoint, session):
    target = Merchant(answer(200))
    moved = Merchant(answer(302, f"Location: {await endpoint(target)}\r\n"))

    got = await delivery.post(session, claimed(await endpoint(moved)), timeout=2)

    assert (got.status_code, got.error_class) == (302, "http_status")
    assert len(moved.requests) == 1 and target.requests == []


@pytest.mark.parametrize("header, expected", [("7", 7.0), ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0), ("soon", None)])
async def test_retry_after_is_read_in_seconds_or_as_a_date(endpoint, session, header, expected):
    got = await delivery.post(session, claimed(await endpoint(Merchant(answer(429, f"Retry-After: {header}\r\n")))),
                              timeout=2)
    assert got.retry_after == expected


async def test_a_huge_body_is_not_read(endpoint, session):
    endless = b"HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\n\r\n" + b"x" * 65536

    got = await delivery.post(session, claimed(await endpoint(Merchant(endless))), timeout=2)

    assert (got.status_code, got.error_class) == (200, None)


async def test_a_merchant_that_never_answers_is_a_timeout_within_the_total(endpoint, session):
    started = asyncio.get_running_loop().time()

    got = await delivery.post(session, claimed(await endpoint(Merchant("hang"))), timeout=0.3)

    assert (got.status_code, got.error_class) == (None, "timeout") and got.error
    assert asyncio.get_running_loop().time() - started < 2


async def test_a_refused_connection_is_a_connection_error(session):
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/webhooks"
    got = await delivery.post(session, claimed(url), timeout=2)
    assert (got.status_code, got.error_class) == (None, "connection") and "Connect" in got.error


@pytest.mark.parametrize("raw", ["close", b"SSH-2.0-OpenSSH_9.2 this is not HTTP\r\n\r\n"])
async def test_a_hang_up_or_an_answer_that_is_not_http_is_a_connection_error(endpoint, session, raw):
    got = await delivery.post(session, claimed(await endpoint(Merchant(raw))), timeout=2)
    assert (got.status_code, got.error_class) == (None, "connection")


@pytest.mark.parametrize("url", ["http://", "http://host:99999/x", "http://[::1/x", "ftp://x/y", "http://a..b/x"])
async def test_a_url_that_cannot_be_posted_to_is_a_connection_error_not_an_exception(session, url):
    got = await delivery.post(session, claimed(url), timeout=2)
    assert (got.status_code, got.error_class) == (None, "connection")


class SlowBody(Merchant):
    """Sends its answer's head, then its body only when the test says: a framework that writes them apart."""

    def __init__(self, body: bytes) -> None:
        super().__init__(b"")
        self.body = body
        self.head_sent = asyncio.Event()
        self.send_body = asyncio.Event()

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                await self.read_request(reader)
                writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(self.body)}\r\n\r\n".encode())
                await writer.drain()
                self.head_sent.set()
                await self.send_body.wait()
                writer.write(self.body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_a_body_sent_after_the_head_is_read_so_the_connection_carries_the_next_webhook(endpoint, session):
    # Left unread, the answer's connection would be closed, and the next
    # webhook would open another: two connections instead of one.
    merchant = SlowBody(b'{"status":"applied"}')
    url = await endpoint(merchant)

    first = asyncio.create_task(delivery.post(session, claimed(url), timeout=2))
    await merchant.head_sent.wait()
    merchant.send_body.set()
    assert (await first).error_class is None
    assert (await delivery.post(session, claimed(url), timeout=2)).error_class is None

    assert (len(merchant.requests), merchant.connections) == (2, 1)


# -- the client's connections (app/outbox/http1.py) -----------------------------------


async def test_an_interim_answer_is_passed_over_for_the_real_one(endpoint, session):
    merchant = Merchant(b"HTTP/1.1 100 Continue\r\n\r\n" + answer(201, body=b"{}"))
    got = await delivery.post(session, claimed(await endpoint(merchant)), timeout=2)
    assert (got.status_code, got.error_class) == (201, None)


@pytest.mark.parametrize("raw", [
    b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}",  # HTTP/1.0: not kept alive unless it says so
    b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}",
    # No length, and the body not over with the head: not waited for, and its connection not used again.
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n400\r\nthe first bytes of many",
])
async def test_an_answer_that_does_not_keep_its_connection_costs_the_next_webhook_a_new_one(endpoint, session, raw):
    merchant = Merchant(raw)
    url = await endpoint(merchant)

    for _ in range(2):
        assert (await delivery.post(session, claimed(url), timeout=2)).error_class is None

    assert (len(merchant.requests), merchant.connections) == (2, 2)


async def test_a_connection_idle_past_the_keep_alive_is_not_used_again(endpoint, session, monkeypatch):
    merchant = Merchant(answer(200, body=b"{}"))
    url = await endpoint(merchant)
    assert (await delivery.post(session, claimed(url), timeout=2)).error_class is None

    monkeypatch.setattr(http1, "KEEP_ALIVE_SECONDS", 0.0)  # every idle connection is now too old
    assert (await delivery.post(session, claimed(url), timeout=2)).error_class is None

    assert merchant.connections == 2


def test_an_idle_connection_is_given_up_a_second_before_a_common_server_closes_it():
    """uvicorn (the fake merchant's server, and many a merchant's) closes a connection idle for its keep-alive.

    Bug caught: the client's keep-alive equal to the server's (5 s, as until
    2026-12-05), so that a connection picked just before the server's timer
    ends is closed under the POST: the POST fails as a `connection` error and
    its events wait for their retries (seen in `make
    bench-webhook-instructions`: a list of 16 events).
    """
    servers = inspect.signature(uvicorn.Config.__init__).parameters["timeout_keep_alive"].default
    assert http1.KEEP_ALIVE_SECONDS <= servers - 1


class Held(Merchant):
    """Answers 204 only when the test lets it: counts the requests it holds meanwhile."""

    def __init__(self) -> None:
        super().__init__(answer(204))
        self.release = asyncio.Event()
        self.holding = 0

    async def read_request(self, reader: asyncio.StreamReader) -> None:
        await super().read_request(reader)
        self.holding += 1
        await self.release.wait()


async def test_no_more_connections_are_open_than_the_client_may_have(endpoint):
    merchant = Held()
    url = await endpoint(merchant)
    async with delivery.session(max_connections=3, policy=egress.development()) as http:
        posts = [asyncio.create_task(delivery.post(http, claimed(url), timeout=5)) for _ in range(7)]
        async def three_held() -> bool:
            return merchant.holding >= 3

        await until(three_held, "three requests held by the merchant", timeout=5)
        assert merchant.connections == 3 and not any(p.done() for p in posts)
        merchant.release.set()
        answers = await asyncio.gather(*posts)

    assert {a.status_code for a in answers} == {204} and len(merchant.requests) == 7
    assert merchant.connections == 3, "the waiting POSTs went out on the connections already open"


async def test_a_header_value_with_a_line_break_is_not_sent(endpoint, session):
    merchant = Merchant(answer(204))
    url = await endpoint(merchant)
    with pytest.raises(ValueError, match="line break"):
        await session.post(url, b"{}", {"webhook-id": "x\r\nX-Injected: 1"}, timeout=2)
    assert merchant.requests == []


async def test_a_path_a_request_line_cannot_carry_is_sent_percent_encoded(endpoint, session):
    merchant = Merchant(answer(204))
    url = await endpoint(merchant)

    got = await delivery.post(session, claimed(url + "/für uns?x=%41"), timeout=2)

    assert got.error_class is None
    assert merchant.requests[0][0].split(b"\r\n")[0] == b"POST /webhooks/f%C3%BCr%20uns?x=%41 HTTP/1.1"


async def test_a_connection_left_idle_is_closed_though_no_webhook_goes_to_its_endpoint_again(
    endpoint, session, monkeypatch
):
    closed = asyncio.Event()

    class Watched(Merchant):
        async def __call__(self, reader, writer):
            await super().__call__(reader, writer)
            closed.set()  # the dispatcher's side hung up: the loop above read its end

    monkeypatch.setattr(http1, "KEEP_ALIVE_SECONDS", 0.05)
    url = await endpoint(Watched(answer(200, body=b"{}")))
    assert (await delivery.post(session, claimed(url), timeout=2)).error_class is None

    await asyncio.wait_for(closed.wait(), timeout=2)  # no other POST: the sweep alone closes it
    assert session.idle == {}
