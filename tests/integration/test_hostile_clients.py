"""Clients that do not play along: they go away mid-body, send their bodies a byte at a time, or open
hundreds of connections; the API stays answerable to everyone else and its log stays quiet.

Every test talks to a real `payments api` over raw sockets (the misbehaviour
is below what an HTTP client library lets one do), and asserts on what the
process did: its answers, its log file, the payments its other clients made
(key rows and the fake PSP's charges).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid

from tests.support import charges, headers, key_row, payment_body, until

OPERATOR_TOKEN = secrets.token_urlsafe(32)
ABORTS = 10  # per path


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


async def _abort_mid_body(url: str, path: str, extra_headers: str = "") -> None:
    """A POST whose head and the first part of its body arrive, then the client closes the connection."""
    reader, writer = await asyncio.open_connection(*_host_port(url))
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: api\r\nContent-Type: application/x-www-form-urlencoded\r\n"
        f"Content-Length: 2000\r\n{extra_headers}\r\n".encode() + b"token=" + b"x" * 200
    )
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def test_clients_that_go_away_mid_body_cost_one_info_line_each_and_no_traceback(processes):
    api = processes.api("api-aborted", OPERATOR_TOKEN=OPERATOR_TOKEN, LOG_FORMAT="json", LOG_LEVEL="INFO")

    # The start-up probe's line ("the database at ... answers") can reach the
    # log after the API already answers: count from after it (a .ci/run failure).
    async def started() -> bool:
        return any('"app.main"' in line and "answers" in line for line in api.log.read_text().splitlines())

    await until(started, "the API's start-up probe to log that the database answers")
    before = len(api.log.read_text().splitlines())
    # The rail's path needs signature headers (bad ones do) to be read at all:
    # an unsigned notification is refused before its body is read.
    signed = "webhook-id: msg_1\r\nwebhook-timestamp: 1\r\nwebhook-signature: v1,AAAA\r\n"
    paths = {"/console/login": "", "/v1/rail/notifications": signed, "/v1/payments": ""}
    for path, extra in paths.items():
        await asyncio.gather(*(_abort_mid_body(api.url, path, extra) for _ in range(ABORTS)))

    def new_lines() -> list[str]:
        return api.log.read_text().splitlines()[before:]

    async def each_abort_seen() -> bool:
        lines = new_lines()
        return all(sum(path in line for line in lines) >= ABORTS for path in ("/console/login", "/v1/rail/notifications"))

    await until(each_abort_seen, "a line about each aborted request", timeout=30)
    lines = new_lines()
    shown = "\n".join(line[:300] for line in lines[:6])
    assert not any("Traceback" in line for line in lines), shown
    records = [json.loads(line) for line in lines]
    assert [r for r in records if r["level"] != "INFO"] == []
    # One line per aborted read, and none for /v1/payments (FastAPI answers an
    # unreadable body 400, to nobody): 2 x ABORTS lines, not hundreds.
    assert len(records) == 2 * ABORTS, shown


async def _read_answer(reader: asyncio.StreamReader, wait: float) -> bytes:
    """Everything the server sends until it closes the connection; b"" for a reset. Fails after `wait` seconds."""
    try:
        return await asyncio.wait_for(reader.read(), wait)
    except ConnectionError:
        return b""


def _status(answer: bytes) -> int | None:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None


def _problem(answer: bytes) -> dict:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])


async def _refused(http, api, reason: str) -> float:
    response = await http.get(f"http://127.0.0.1:{api.env['API_METRICS_PORT']}/metrics")
    for line in response.text.splitlines():
        if line.startswith(f'payments_http_refused_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


async def test_a_body_that_does_not_arrive_in_time_is_answered_408_and_counted(http, processes):
    api = processes.api("api-slow-body", BODY_TIMEOUT_SECONDS="1")
    reader, writer = await asyncio.open_connection(*_host_port(api.url))
    # The head, and 10 of the 5000 bytes it announces; then nothing.
    writer.write(b"POST /v1/payments HTTP/1.1\r\nHost: api\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 5000\r\n\r\n{\"amount\":")
    await writer.drain()
    started = asyncio.get_running_loop().time()
    answer = await _read_answer(reader, wait=15)
    writer.close()

    assert _status(answer) == 408, answer[:200]
    assert _problem(answer)["type"] == "/problems/request-timeout"
    assert 0.9 < asyncio.get_running_loop().time() - started < 15

    async def counted() -> bool:
        return await _refused(http, api, "body_timeout") == 1

    await until(counted, "the 408 to be counted")


async def test_an_unsigned_notification_is_refused_401_before_its_body_is_read(processes):
    api = processes.api("api-unsigned", BODY_TIMEOUT_SECONDS="1")
    reader, writer = await asyncio.open_connection(*_host_port(api.url))
    # 16000 bytes announced, none sent: the answer cannot wait for them.
    writer.write(b"POST /v1/rail/notifications HTTP/1.1\r\nHost: api\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 16000\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert _status(head) == 401, head
    # The answer was given without the body; the connection is not kept
    # waiting for it past the body deadline.
    rest = await _read_answer(reader, wait=15)
    writer.close()
    assert json.loads(rest)["type"] == "/problems/rail-unauthenticated"
    assert "webhook-signature" in json.loads(rest)["detail"]


ATTACKERS = 300
PER_PEER = 20
DEADLINE = 3.0


async def test_slow_bodies_from_one_address_leave_healthz_and_paying_clients_answered(http, db, acme, processes):
    # Small bounds, so the run takes seconds: 300 slow connections would fill
    # LIMIT_CONCURRENCY=60 five times over. 127.0.0.1 is no trusted proxy
    # here: the paying client is bounded like any other peer.
    api = processes.api("api-under-attack", LIMIT_CONCURRENCY="60", MAX_CONNECTIONS_PER_PEER=str(PER_PEER),
                        BODY_TIMEOUT_SECONDS=str(DEADLINE), FORWARDED_ALLOW_IPS="")
    host, port = _host_port(api.url)
    # All of them connected first, from a second loopback address: the
    # bound counts what one address holds at once. Each reads whatever the
    # server sends until it closes the connection.
    connections = await asyncio.gather(*(
        asyncio.open_connection(host, port, local_addr=("127.0.0.2", 0)) for _ in range(ATTACKERS)))
    answers = [asyncio.ensure_future(_read_answer(reader, wait=DEADLINE + 30)) for reader, _ in connections]

    async def all_but_the_cap_refused() -> bool:
        return sum(answer.done() for answer in answers) == ATTACKERS - PER_PEER

    await until(all_but_the_cap_refused, "the connections past the cap to be refused", timeout=30)
    refused = [answer.result() for answer in answers if answer.done()]
    assert {_status(answer) for answer in refused} == {429}
    assert _problem(refused[0])["type"] == "/problems/too-many-connections"
    held = [(n, answer, writer) for n, (answer, (_, writer)) in enumerate(zip(answers, connections))
            if not answer.done()]
    assert len(held) == PER_PEER

    async def attack(n: int, answer: asyncio.Future, writer: asyncio.StreamWriter) -> tuple[bytes, float]:
        """A head announcing 5000 bytes, then a byte every half second: what came back, and after how long."""
        path = "/v1/payments" if n % 2 else "/v1/rail/notifications"
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            writer.write(f"POST {path} HTTP/1.1\r\nHost: api\r\nContent-Type: application/json\r\n"
                         "Content-Length: 5000\r\n\r\n".encode())
            while not answer.done():
                writer.write(b" ")
                await writer.drain()
                await asyncio.wait({answer}, timeout=0.5)  # the trickle's pace, not a synchronisation
        except ConnectionError:
            pass  # cut off while writing: the answer says how
        finally:
            writer.close()
        return await answer, loop.time() - started

    attacking = asyncio.gather(*(attack(n, answer, writer) for n, answer, writer in held))

    # Meanwhile, a client on 127.0.0.1 pays, and the health check answers.
    paid = []
    for _ in range(5):
        assert (await http.get(api.url + "/healthz")).status_code == 200
        key, body = str(uuid.uuid4()), payment_body()
        response = await http.post(api.url + "/v1/payments", json=body, headers=headers(acme, key))
        assert response.status_code == 201, response.text
        paid.append((key, body["reference"]))

    outcomes = await attacking
    for key, reference in paid:
        assert (await key_row(db, acme.id, key))["state"] == "finished"
        assert len(await charges(db, reference)) == 1
    # Every slow connection the server took was cut off at the deadline:
    # 408 when the app waited for the body (the payments, odd n); for an
    # unsigned notification (even n), a 401 given at once, without the body,
    # then the connection closed. Either close comes while the client is
    # still trickling bytes the server never read, so the kernel may reset
    # the connection, and a reset can discard the answer still unread in
    # the client's buffer (b"", no status): what the server did is proved by
    # the durations here and the counts below (a lone slow body's 408 is
    # read whole in test_a_body_that_does_not_arrive_in_time_is_answered_408_and_counted).
    # None is still open.
    paths = [n % 2 for n, _, _ in held]
    assert {_status(answer) for odd, (answer, _) in zip(paths, outcomes) if odd} <= {408, None}, outcomes
    assert {_status(answer) for odd, (answer, _) in zip(paths, outcomes) if not odd} <= {401, None}, outcomes
    assert all(DEADLINE - 0.5 < took < DEADLINE + 20 for _, took in outcomes), [took for _, took in outcomes]

    async def each_counted() -> bool:
        return (await _refused(http, api, "peer_connections"), await _refused(http, api, "body_timeout")) == (
            ATTACKERS - PER_PEER, PER_PEER)

    await until(each_counted, "each refusal and each cut-off to be counted")
