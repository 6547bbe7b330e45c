"""How `payments api --workers N` keeps each worker's share of the connections even (app/fastpath/reuse_port.py)."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import pytest

from app.fastpath import reuse_port
from app.fastpath.reuse_port import Share, bind, claim, excess, port_connections
from tests.support import until


def test_a_worker_over_its_share_rounded_up_lets_the_rest_go_and_one_alone_or_within_it_keeps_all():
    assert excess(20, listening=2, established=32, workers=2) == 4
    assert excess(17, listening=2, established=33, workers=2) == 0  # 17/16: the share rounded up
    assert excess(16, listening=2, established=32, workers=2) == 0
    assert excess(12, listening=3, established=32, workers=3) == 1
    assert excess(30, listening=1, established=30, workers=2) == 0  # the other dead or not yet listening


def test_a_listener_beyond_the_workers_another_programs_makes_no_share_smaller():
    assert excess(16, listening=3, established=32, workers=2) == 0


def test_the_port_count_sees_each_workers_socket_and_the_accepted_connections_and_nothing_of_another_port():
    port = claim("127.0.0.1", 0)
    listeners = [bind("127.0.0.1", port) for _ in range(2)]
    other = socket.create_server(("127.0.0.1", 0))
    opened: list[socket.socket] = []
    try:
        for sock in listeners:
            sock.listen()
        opened += [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        opened.append(socket.create_connection(other.getsockname()))

        assert port_connections(port) == (2, 3)
    finally:
        for sock in [*opened, *listeners, other]:
            sock.close()


class Table:
    """The port's table as a worker reads it (`port_connections`), fixed, and how often it was read."""

    def __init__(self, listening: int, established: int) -> None:
        self.counts, self.reads = (listening, established), 0

    def __call__(self, port: int) -> tuple[int, int]:
        self.reads += 1
        return self.counts


class Connection:
    """A connection as the check sees it: something to mark `leaving`."""


def a_share(held: int, table: Table, monkeypatch: pytest.MonkeyPatch) -> Share:
    """A worker of two holding `held` connections, reading `table` for the port's."""
    monkeypatch.setattr(reuse_port, "port_connections", table)
    state = SimpleNamespace(connections={Connection() for _ in range(held)})
    return Share(state, port=8000, workers=2)  # type: ignore[arg-type]


@pytest.mark.parametrize("held", [0, 1])
def test_a_worker_holding_one_connection_or_none_is_within_its_share_without_reading_the_table(held, monkeypatch):
    table = Table(listening=2, established=30)
    share = a_share(held, table, monkeypatch)

    assert share.check() == 0
    assert table.reads == 0


def test_a_worker_over_its_share_marks_that_many_to_leave_and_counts_them_out_at_the_next_look(monkeypatch):
    table = Table(listening=2, established=6)
    share = a_share(5, table, monkeypatch)

    assert share.check() == 2  # 5 held, 3 its share
    assert sum(getattr(c, "leaving", False) for c in share.state.connections) == 2
    assert share.check() == 0  # the two leaving are not counted again
    assert table.reads == 2


async def yielded(times: int = 200) -> None:
    """Let the event loop run everything ready, `times` over (no time passes: CHECK_EVERY_SECONDS is 0)."""
    for _ in range(times):
        await asyncio.sleep(0)


async def test_a_settled_worker_reads_the_table_again_only_when_a_connection_arrives(monkeypatch):
    monkeypatch.setattr(reuse_port, "CHECK_EVERY_SECONDS", 0)
    monkeypatch.setattr(reuse_port, "SETTLED_CHECK_SECONDS", 3600)
    table = Table(listening=2, established=4)
    share = a_share(2, table, monkeypatch)  # 2 of 4: its share
    task = asyncio.create_task(share.keep())
    try:
        await until(_read(table, 1), "the first look")
        await yielded()
        assert table.reads == 1, "a settled worker read the table with no connection arriving"

        share.arrived.set()
        await until(_read(table, 2), "a look after a connection arrived")
        await yielded()
        assert table.reads == 2
    finally:
        task.cancel()


async def test_a_worker_that_found_some_over_looks_again_without_waiting_for_an_arrival(monkeypatch):
    monkeypatch.setattr(reuse_port, "CHECK_EVERY_SECONDS", 0)
    monkeypatch.setattr(reuse_port, "SETTLED_CHECK_SECONDS", 3600)
    table = Table(listening=2, established=6)
    share = a_share(5, table, monkeypatch)  # 2 over; then, those leaving, within its share
    task = asyncio.create_task(share.keep())
    try:
        await until(_read(table, 2), "a second look, the first having found some over")
        await yielded()
        assert table.reads == 2
    finally:
        task.cancel()


def _read(table: Table, times: int):
    async def done() -> bool:
        return table.reads >= times
    return done
