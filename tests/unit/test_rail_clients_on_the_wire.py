"""Every class of answer, over real sockets, through the transport the service uses in production.

Each test starts a tiny TCP server on loopback that answers the way a real
PSP, rail, proxy or broken network might, and calls it with the client built
exactly as `app/services.py` builds it (`app.rails.transport.http_client`,
aiohttp underneath httpx). What comes back must be one of the outcomes of
app/rails/outcomes.py, by the allow-list in app/rails/gateways.py:

    applied      only a 2xx whose body is a documented answer with a final status
    not applied  only when nothing can have been done: a refused connection,
                 a documented refusal (429, 400)
    unknown      everything else: a server that closes without answering,
                 bytes that are not HTTP, a body that is not JSON, a status we
                 were never told about, a timeout, a 5xx
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
from collections.abc import Awaitable, Callable

import aiohttp.connector
import pytest
import uvicorn

from app.rails.answers import Charge, Transfer
from app.rails.gateways import PSP, Rail
from app.rails.outcomes import Applied, NotApplied, NotFound, Unknown
from app.rails.transport import http_client

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class _Payment:
    id = "p"
    amount_minor = 100
    net_minor = 75
    currency = "EUR"
    card_token = "tok_visa"
    reference = "r"
    psp_charge_id = "ch_1"
    end_to_end_reference = "E2E1"
    beneficiary_iban = "DE89370400440532013000"
    beneficiary_name = "Ada"


class Server:
    """A loopback server that gives every request the next of `answers` (the last one repeats)."""

    def __init__(self, *answers: Handler) -> None:
        self.answers = list(answers)
        self.requests = 0
        self.connections = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")),
                    0,
                )
                await reader.readexactly(length)
                answer = self.answers[min(self.requests, len(self.answers) - 1)]
                self.requests += 1
                await answer(reader, writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def http(status: int, body: bytes, content_type: str = "application/json", extra: str = "") -> Handler:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
            + body
        )
        await writer.drain()

    return answer


def json_answer(status: int, value: object, content_type: str = "application/json", extra: str = "") -> Handler:
    return http(status, json.dumps(value).encode(), content_type, extra)


async def close_without_answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"SSH-2.0-OpenSSH_9.2 this is not HTTP\r\n\r\n")
    await writer.drain()
    writer.close()


async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.Event().wait()  # cancelled when the server closes


@pytest.fixture
async def client():
    async with http_client() as http:
        yield http


def psp(client, url: str) -> PSP:
    return PSP(client, url, timeout=0.5, transient_retries=2)


def refused_url() -> str:
    """A loopback port nobody listens on: connecting to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


CHARGE = {"id": "ch_1", "object": "charge", "status": "succeeded", "amount": 100}
NOT_FOUND = {"type": "https://fake-rails.example/problems/not-found", "title": "Not found", "status": 404}


async def test_a_documented_charge_is_applied_with_its_typed_record(serve, client):
    server = Server(json_answer(201, CHARGE))
    assert await psp(client, await serve(server)).charge("k1", _Payment()) == Applied(Charge(id="ch_1", status="succeeded"))


async def test_a_connection_idle_almost_as_long_as_a_common_servers_keep_alive_is_not_used_again(
    serve, client, monkeypatch
):
    """uvicorn (the fakes' server, and many a PSP's) closes a connection idle for its keep-alive, 5 s.

    Bug caught: the client keeping an idle connection as long as the server
    does (httpx's default, 5 s), so that a charge is written on a
    connection just as the server closes it: the charge is lost unanswered,
    an Unknown outcome for a call the PSP never received.
    """
    server = Server(json_answer(201, CHARGE))
    url = await serve(server)
    assert await psp(client, url).charge("k1", _Payment()) == Applied(Charge(id="ch_1", status="succeeded"))
    assert server.connections == 1

    # The pool's clock moves on to half a second before the server's close.
    servers = inspect.signature(uvicorn.Config.__init__).parameters["timeout_keep_alive"].default
    now = aiohttp.connector.monotonic
    monkeypatch.setattr(aiohttp.connector, "monotonic", lambda: now() + servers - 0.5)

    assert await psp(client, url).charge("k1", _Payment()) == Applied(Charge(id="ch_1", status="succeeded"))
    assert server.connections == 2, "the idle connection was used again"


async def test_a_refused_connection_is_not_applied_and_retried_inline(client):
    # Nothing listens: the request is never written, so it certainly did nothing.
    outcome = await psp(client, refused_url()).charge("k1", _Payment())
    assert outcome == NotApplied("psp: cannot connect")


async def test_a_name_that_does_not_resolve_is_not_applied(client):
    outcome = await PSP(client, "http://no-such-host.invalid", 0.5, 0).charge("k1", _Payment())
    assert isinstance(outcome, NotApplied)


async def test_a_server_that_closes_without_answering_is_unknown(serve, client):
    server = Server(close_without_answering)
    outcome = await psp(client, await serve(server)).charge("k1", _Payment())
    assert outcome == Unknown("psp: no valid HTTP answer")


async def test_bytes_that_are_not_http_are_unknown_not_an_exception(serve, client):
    server = Server(not_http)
    outcome = await psp(client, await serve(server)).charge("k1", _Payment())
    assert outcome == Unknown("psp: no valid HTTP answer")


async def test_a_2xx_body_that_is_not_json_is_unknown(serve, client):
    server = Server(http(200, b"<html>proxy says hi</html>", "text/html"))
    assert await psp(client, await serve(server)).charge("k1", _Payment()) == Unknown("psp: malformed answer")


@pytest.mark.parametrize(
    "body",
    [
        {"id": "ch_1", "status": "pending"},  # a status we were never told about
        {"id": "ch_1", "status": "SUCCEEDED"},  # not the documented spelling
        {"id": "ch_1", "status": "failed"},  # sounds like a decline; is not one we know
    ],
)
async def test_an_undocumented_charge_status_is_unknown_never_a_decline(serve, client, body):
    server = Server(json_answer(201, body))
    outcome = await psp(client, await serve(server)).charge("k1", _Payment())
    assert outcome == Unknown(f"psp: undocumented status {body['status']!r}")


@pytest.mark.parametrize(
    "body", [{"id": "ch_1"}, {"status": "succeeded"}, {"id": 7, "status": "succeeded"}, ["succeeded"], "succeeded", None]
)
async def test_a_2xx_without_a_documented_id_and_status_is_unknown(serve, client, body):
    server = Server(json_answer(200, body))
    assert isinstance(await psp(client, await serve(server)).charge("k1", _Payment()), Unknown)


async def test_a_pending_transfer_is_unknown_so_it_is_never_refunded(serve, client):
    # Real rails answer "pending" for payouts not yet final: the money may
    # still leave, so this must never read as a rejection.
    server = Server(json_answer(201, {"id": "tr_1", "status": "pending"}))
    rail = Rail(client, await serve(server), 0.5, 2)
    assert await rail.transfer("k2", _Payment()) == Unknown("rail: undocumented status 'pending'")
    found = Server(json_answer(200, {"id": "tr_1", "status": "pending"}))
    assert isinstance(await Rail(client, await serve(found), 0.5, 2).find_transfer("E2E1"), Unknown)


async def test_a_documented_rejection_is_applied(serve, client):
    server = Server(json_answer(201, {"id": "tr_1", "status": "rejected", "reject_reason": "account_closed"}))
    outcome = await Rail(client, await serve(server), 0.5, 2).transfer("k2", _Payment())
    assert outcome == Applied(Transfer(id="tr_1", status="rejected", reject_reason="account_closed"))


async def test_a_timeout_is_unknown(serve, client):
    server = Server(never_answer)
    assert await psp(client, await serve(server)).charge("k1", _Payment()) == Unknown("psp: timed out")


async def test_a_5xx_is_unknown_because_it_may_have_applied(serve, client):
    server = Server(json_answer(500, {"title": "oops"}))
    assert await psp(client, await serve(server)).charge("k1", _Payment()) == Unknown("psp: HTTP 500")
    assert server.requests == 1  # a 500 is not retried inline


async def test_a_documented_refusal_is_not_applied_and_not_retried(serve, client):
    server = Server(json_answer(400, {"title": "Invalid request"}, "application/problem+json"))
    assert await psp(client, await serve(server)).charge("k1", _Payment()) == NotApplied("psp: refused (HTTP 400)")
    assert server.requests == 1


async def test_a_429_then_a_charge_is_retried_inline_with_the_same_key(serve, client):
    server = Server(json_answer(429, {"title": "slow down"}, extra="Retry-After: 0\r\n"), json_answer(201, CHARGE))
    assert await psp(client, await serve(server)).charge("k1", _Payment()) == Applied(Charge(id="ch_1", status="succeeded"))
    assert server.requests == 2


async def test_a_legacy_payout_is_never_resent_inline_after_an_unknown(serve, client):
    # A 503 may have been applied; a rail that cannot deduplicate would pay twice.
    server = Server(json_answer(503, {"title": "busy"}, extra="Retry-After: 0\r\n"))
    rail = Rail(client, await serve(server), 0.5, 2, legacy=True)
    assert await rail.transfer("k2", _Payment()) == Unknown("rail: HTTP 503")
    assert server.requests == 1


async def test_a_legacy_payout_is_resent_inline_after_a_429(serve, client):
    server = Server(json_answer(429, {"title": "slow down"}, extra="Retry-After: 0\r\n"), json_answer(201, {"id": "tr_1", "status": "accepted"}))
    rail = Rail(client, await serve(server), 0.5, 2, legacy=True)
    assert await rail.transfer("k2", _Payment()) == Applied(Transfer(id="tr_1", status="accepted"))
    assert server.requests == 2


async def test_a_probe_is_not_found_only_on_the_documented_not_found_problem(serve, client):
    documented = Server(json_answer(404, NOT_FOUND, "application/problem+json"))
    assert await psp(client, await serve(documented)).find_charge("k1") == NotFound()
    for answer in (http(404, b"<html>Not Found</html>", "text/html"), not_http, close_without_answering):
        assert isinstance(await psp(client, await serve(Server(answer))).find_charge("k1"), Unknown)
    # A probe that cannot connect learns nothing either.
    assert isinstance(await psp(client, refused_url()).find_charge("k1"), Unknown)


async def test_reasons_are_short_and_never_carry_a_url_or_a_body(serve, client):
    url = await serve(Server(http(502, b"upstream secret-token-123 failed", "text/plain")))
    outcome = await psp(client, url).charge("k1", _Payment())
    assert outcome == Unknown("psp: HTTP 502")
    assert url not in outcome.reason and "secret" not in outcome.reason
