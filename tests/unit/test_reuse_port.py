"""How `payments api --workers N` keeps each worker's share of the connections even (app/fastpath/reuse_port.py)."""

from __future__ import annotations

import socket

from app.fastpath.reuse_port import bind, claim, excess, port_connections


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
