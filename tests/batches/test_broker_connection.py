"""The connection to the broker (app/broker/jetstream.py::connect) when the broker goes away, on a real nats-server.

A broker gone is a pause the connection rides out: each error it meets
meanwhile is one warning line of ours, never nats-py's default of an ERROR
with a traceback for every attempt to reconnect (what `make run` printed
on every Ctrl-C, which stops the server and the consumer at once), and the
connection is back once the server is.
"""

from __future__ import annotations

import logging

from app.broker import jetstream
from devtools.embedded_nats import nats_broker
from devtools.processes import child_env
from tests.support import until


async def test_each_error_of_a_broker_gone_is_one_warning_line_and_the_connection_comes_back(tmp_path, caplog):
    broker = nats_broker(tmp_path / "nats", env=child_env(), log=tmp_path / "nats-server.log")
    server = broker.process.start()
    caplog.set_level(logging.INFO)
    nc = await jetstream.connect(broker.url, "test-connection")
    try:
        server.stop()
        assert server.wait() is not None

        def reported() -> list[logging.LogRecord]:  # by us, or by nats-py's own default
            return [r for r in caplog.records if r.name in (jetstream.__name__, "nats.aio.client")]

        async def met_twice() -> bool:  # the server's end of the connection, then an attempt refused
            return len(reported()) >= 2

        await until(met_twice, "two errors met while the broker is away", timeout=15)
        assert all(r.name == jetstream.__name__ for r in reported()), caplog.text
        assert all(r.levelno == logging.WARNING and r.exc_info is None for r in reported()), caplog.text
        assert all("\n" not in r.getMessage() for r in reported()), caplog.text

        server.start()  # same port, same store

        async def back() -> bool:
            return nc.is_connected

        await until(back, "the connection back on the restarted broker", timeout=15)
        await nc.flush(timeout=5)  # and it carries a round trip
    finally:
        await nc.close()
        server.stop()
