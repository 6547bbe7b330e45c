"""payments_client's connections: an idle one is given up before the service would close it.

A loopback HTTP/1.1 server counts the connections the client opens; the
client's connection pool is told that time has moved on, as it would be
after an idle pause, by replacing the clock its HTTP/1.1 connections read.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpcore._sync.http11 as http11
import pytest

from app.cli import TIMEOUT_KEEP_ALIVE
from payments_client import PaymentsClient


class Counting(ThreadingHTTPServer):
    daemon_threads = True
    connections = 0


class Answer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keeps the connection alive between requests

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1  # once per connection accepted

    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[Counting]:
    server = Counting(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_an_idle_connection_is_given_up_a_second_before_the_service_closes_it(server, tmp_path, monkeypatch):
    """`payments api` closes a kept-alive connection after TIMEOUT_KEEP_ALIVE (5 s) idle.

    Bug caught: the client keeping an idle connection as long as the server
    does (httpx's default, 5 s), so that a payment is written on a
    connection just as the service closes it: an attempt lost to a
    transport error, and a retry.
    """
    url = f"http://127.0.0.1:{server.server_address[1]}/healthz"
    with PaymentsClient(url, "sk_test", store=tmp_path / "operations.json") as client:
        client.http.get(url).raise_for_status()
        assert server.connections == 1

        # The pool's clock moves on to half a second before the service's close.
        now = http11.time.monotonic
        monkeypatch.setattr(http11, "time", SimpleNamespace(monotonic=lambda: now() + TIMEOUT_KEEP_ALIVE - 0.5))

        client.http.get(url).raise_for_status()
        assert server.connections == 2, "the idle connection was used again"
