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
