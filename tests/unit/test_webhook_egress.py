"""The webhook egress policy (app/outbox/egress.py): what may be registered, what the dispatcher connects to.

Registration refuses http (unless allowed), credentials in the URL and every
inside address in every spelling; the dispatcher, with the policy's own
connector, never connects to a refused address, whatever the URL says and
whatever a name resolves to at the time (a rebinding resolver), and records
one phrase for all of them. The https path runs against a loopback TLS
server whose certificate a throwaway CA (trustme) signed, trusted through
WEBHOOK_CA_FILE's setting.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
import trustme

from app.config import Settings
from app.outbox import delivery, egress, http1
from app.outbox.delivery import Claimed
from app.outbox.egress import EgressPolicy, InvalidWebhookUrl, RefusedAddress
from app.outbox.endpoints import checked_url, new_secret

STRICT = EgressPolicy()  # the default: public https only
INSIDE = [
    "127.0.0.1", "localhost", "[::1]", "0x7f000001", "2130706433", "127.1", "017700000001",
    "169.254.169.254", "[fe80::1]", "0.0.0.0", "[::]", "[::ffff:127.0.0.1]", "[::ffff:169.254.169.254]",
    "[::127.0.0.1]", "[2002:7f00:1::]", "10.0.0.1", "172.16.0.1", "192.168.1.1", "100.64.0.1",
    "224.0.0.1", "[ff02::1]", "240.0.0.1", "255.255.255.255", "[fc00::1]", "[64:ff9b::7f00:1]",
]


@pytest.mark.parametrize("host", INSIDE)
def test_an_inside_address_in_any_spelling_is_not_registered(host):
    with pytest.raises(InvalidWebhookUrl, match="not a public address"):
        checked_url(f"https://{host}:8443/webhooks", STRICT)


@pytest.mark.parametrize("url", ["http://merchant.example/webhooks", "http://93.184.215.14/webhooks"])
def test_http_is_refused_unless_allowed(url):
    with pytest.raises(InvalidWebhookUrl, match="WEBHOOK_ALLOW_HTTP"):
        checked_url(url, STRICT)
    assert checked_url(url, EgressPolicy(allow_http=True)) == url


@pytest.mark.parametrize("url", ["https://user:pw@merchant.example/webhooks", "https://user@merchant.example/x",
                                 "http://user:pw@127.0.0.1:8103/webhooks"])
def test_credentials_in_a_url_are_refused_even_in_development(url):
    for policy in (STRICT, egress.development()):
        with pytest.raises(InvalidWebhookUrl, match="user:password"):
            checked_url(url, policy)


@pytest.mark.parametrize("url", ["https://93.184.215.14/webhooks", "https://[2606:4700::1111]/webhooks",
                                 "https://merchant.example/webhooks"])
def test_a_public_address_or_a_name_is_registered(url):
    # merchant.example resolves to nothing here: it is checked again at every connection.
    assert checked_url(url, STRICT) == url


def test_the_development_allow_list_lets_loopback_in_and_nothing_else():
    dev = egress.development()
    assert checked_url("http://127.0.0.1:8103/webhooks", dev)
    assert checked_url("http://localhost:8103/webhooks", dev)
    assert dev.permits("::1") and dev.permits("::ffff:127.0.0.1")
    for refused in ("10.0.0.1", "169.254.169.254", "fe80::1", "0.0.0.0"):
        assert not dev.permits(refused)


def test_the_settings_make_the_policy_and_refuse_a_bad_network():
    settings = Settings(database_url="postgresql://u@h/d", webhook_allowed_networks="127.0.0.1, ::1",
                        webhook_allow_http=True)
    policy = EgressPolicy.from_settings(settings)
    assert policy.allow_http and policy.permits("127.0.0.1") and not policy.permits("127.0.0.2")
    assert EgressPolicy.from_settings(Settings(database_url="postgresql://u@h/d")) == STRICT
    with pytest.raises(ValueError, match="WEBHOOK_ALLOWED_NETWORKS|webhook_allowed_networks"):
        Settings(database_url="postgresql://u@h/d", webhook_allowed_networks="localhost")


# -- at connect time ------------------------------------------------------------


def claimed(url: str) -> Claimed:
    return Claimed(
        event_id=uuid.uuid4(), client_id=1, attempt=1, due_attempt=1, lease_token=uuid.uuid4(), url=url,
        secret=new_secret(), type="payment.succeeded", data='{"id":"p","status":"succeeded"}',
        created_at=datetime(2026, 12, 2, tzinfo=UTC),
    )


class Listener:
    """A loopback server that answers 204 and counts the connections it was given."""

    def __init__(self) -> None:
        self.connections = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length")), 0)
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def listening():
    """An open loopback port (its Listener) and a closed one."""
    listener = Listener()
    server = await asyncio.start_server(listener, "127.0.0.1", 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    yield listener, server.sockets[0].getsockname()[1], closed
    server.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "0x7f000001", "[::1]", "[::ffff:127.0.0.1]", "127.1"])
async def test_the_dispatcher_connects_to_no_refused_address_and_says_one_phrase_for_all(listening, host):
    listener, open_port, closed_port = listening
    # http allowed, so that only the address is in question.
    async with delivery.session(max_connections=4, policy=EgressPolicy(allow_http=True)) as http:
        answers = [await delivery.post(http, claimed(f"http://{host}:{port}/webhooks"), timeout=2)
                   for port in (open_port, closed_port)]
    assert listener.connections == 0, "nothing reached the loopback service"
    # An open port and a closed one read the same, in every spelling (the legacy ones, 127.1 and
    # 0x7f000001, resolve to loopback): nothing tells which inside ports listen.
    assert {(a.status_code, a.error_class, a.error) for a in answers} == {(None, "refused_address", egress.REFUSED)}


def resolving_to(*addresses: str):
    """A resolver (as http1.Client takes one) answering every name with `addresses`, as getaddrinfo would."""
    async def resolve(host: str, port: int) -> list[tuple]:
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (a, port)) for a in addresses]

    return resolve


async def test_a_name_that_resolves_inside_at_delivery_is_refused_though_it_was_registered(listening):
    listener, open_port, _ = listening
    url = f"http://merchant.example:{open_port}/webhooks"
    policy = EgressPolicy(allow_http=True)
    assert checked_url(url, policy) == url  # it resolves to nothing at registration
    # The rebinding DNS answer, at connect time: loopback.
    async with http1.Client(max_connections=4, policy=policy, max_body_read=1024,
                            resolve=resolving_to("127.0.0.1")) as http:
        got = await delivery.post(http, claimed(url), timeout=2)
    assert (got.error_class, got.error, listener.connections) == ("refused_address", egress.REFUSED, 0)


async def test_a_name_with_public_and_inside_addresses_keeps_only_the_public_ones():
    found = await resolving_to("10.1.2.3", "93.184.215.14", "169.254.169.254")("merchant.example", 443)
    assert [info[4][0] for info in egress.permitted(STRICT, found)] == ["93.184.215.14"]
    with pytest.raises(RefusedAddress):
        egress.permitted(STRICT, found[:1] + found[2:])


# -- https, against a CA of the test's own ------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
async def tls_merchant(ca: trustme.CA):
    """A loopback https server whose certificate (localhost, 127.0.0.1) the throwaway CA signed: its port."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", "127.0.0.1").configure_cert(context)
    listener = Listener()
    server = await asyncio.start_server(listener, "127.0.0.1", 0, ssl=context)
    yield listener, server.sockets[0].getsockname()[1]
    server.close()


async def test_https_is_delivered_to_a_certificate_of_the_ca_the_settings_trust(ca, tls_merchant, tmp_path: Path):
    listener, port = tls_merchant
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    settings = Settings(database_url="postgresql://u@h/d", webhook_allowed_networks="127.0.0.1",
                        webhook_ca_file=str(ca_file))
    policy = EgressPolicy.from_settings(settings)
    assert not policy.allow_http
    url = f"https://localhost:{port}/webhooks"
    async with delivery.session(max_connections=4, policy=policy) as http:
        got = await delivery.post(http, claimed(checked_url(url, policy)), timeout=5)
    assert (got.status_code, got.error_class) == (204, None)
    assert listener.connections == 1


async def test_https_to_a_certificate_no_trusted_ca_signed_is_a_tls_error(tls_merchant):
    _, port = tls_merchant
    policy = EgressPolicy(allowed_networks=egress.parse_networks("127.0.0.1"))  # the system's CAs
    async with delivery.session(max_connections=4, policy=policy) as http:
        got = await delivery.post(http, claimed(f"https://localhost:{port}/webhooks"), timeout=5)
    assert (got.status_code, got.error_class) == (None, "tls")


def test_a_ca_file_that_is_not_one_refuses_start_up(tmp_path: Path):
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    with pytest.raises(ValueError, match="PEM bundle"):
        Settings(database_url="postgresql://u@h/d", webhook_ca_file=str(bad))
