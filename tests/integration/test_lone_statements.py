"""The connection a lone statement is lent: in AUTOCOMMIT while it is lent, in transactions again after.

app/db/transaction.py::one_statement (and `read`) lend a pooled connection in
AUTOCOMMIT, so that a phase's one statement is a transaction of its own;
`atomic` lends connections of the same pool inside a transaction. A
connection that went back to the pool still in AUTOCOMMIT would make the
next `atomic` phase commit each of its statements on its own: half a phase
could commit. And a phase's statement on the driver's path hops into
SQLAlchemy's greenlet only where SQLAlchemy needs it (to check the
connection out, set it to AUTOCOMMIT and close it): the driver's connection
under it is read without a hop (app/db/driver.py::driver_of, an
optimisation).
"""

from __future__ import annotations

import greenlet
import pytest
from sqlalchemy import text

from app.config import Settings
from app.db import driver
from app.db.engine import build_engine
from app.db.transaction import atomic, one_statement, read

# txid_current() gives the statement's transaction an id; the backend's pid names the connection.
TXID = text("SELECT txid_current() AS txid, pg_backend_pid() AS pid")


@pytest.fixture
async def engine(database_url):
    # One connection in the pool: every phase below is lent the same one.
    engine = build_engine(Settings(database_url=database_url, db_pool_size=1))
    yield engine
    await engine.dispose()


async def _two_statements(conn) -> tuple[dict, dict]:
    """The transaction and backend of two statements in a row: one on the driver's path, one through SQLAlchemy."""
    first = await driver.fetch_one(conn, TXID, driver.Positional.of(TXID), {})
    second = (await conn.execute(TXID)).mappings().one()
    return dict(first), dict(second)


@pytest.mark.parametrize("lend", [one_statement, read], ids=["one_statement", "read"])
async def test_each_statement_commits_on_its_own_and_the_connection_goes_back_to_transactions(engine, lend):
    first, second = await lend(engine, _two_statements)
    assert first["pid"] == second["pid"]
    assert first["txid"] != second["txid"], "two statements of a lone-statement phase were one transaction"

    after_first, after_second = await atomic(engine, _two_statements)
    assert after_first["pid"] == first["pid"], "the pool lent another connection: the check below proves nothing"
    assert after_first["txid"] == after_second["txid"], "the connection went back to the pool still in AUTOCOMMIT"


async def test_a_lone_statement_on_the_driver_hops_into_sqlalchemys_greenlet_only_to_lend_the_connection(engine):
    async def one(conn) -> dict:
        return dict(await driver.fetch_one(conn, TXID, driver.Positional.of(TXID), {}))

    await one_statement(engine, one)  # the pool's one connection is made, outside the count
    started: set[greenlet.greenlet] = set()  # the greenlets themselves: an id could be reused

    def trace(event: str, args: tuple) -> None:
        if event in ("switch", "throw"):
            started.add(args[1])

    here = greenlet.getcurrent()
    previous = greenlet.settrace(trace)
    try:
        await one_statement(engine, one)
    finally:
        greenlet.settrace(previous)
    # engine.connect(), AUTOCOMMIT, close(): not the phase's bound (a timer on the driver's
    # connection) nor its statement (on the driver's connection).
    assert len(started - {here}) == 3


async def test_the_driver_of_an_invalidated_connection_is_a_new_one_not_an_error(engine):
    async def invalidated_then_driver(conn):
        before = await driver.driver_of(conn)
        await conn.invalidate()
        # Reconnecting is I/O, which SQLAlchemy does only inside its greenlet: read
        # as a plain attribute, this would fail (MissingGreenlet).
        after = await driver.driver_of(conn)
        return before, after

    before, after = await one_statement(engine, invalidated_then_driver)
    assert after is not before
    assert before.is_closed() and not after.is_closed()
