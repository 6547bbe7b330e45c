"""Telling an unreachable database from a bad statement, with the exceptions a real server raises.

Every exception here is provoked for real: a connect to a port nobody listens
on, a backend killed with pg_terminate_backend, a pool with no free
connection, a syntax error, a duplicate key, a statement timeout. The one
exception is CannotConnectNowError ("the database system is starting up"),
which needs a server caught mid-start.
"""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from app.config import asyncpg_url
from app.db.errors import database_unavailable, describe
from app.processes import free_port


def nobody_listens() -> str:
    """A PostgreSQL URL on a loopback port with no server behind it."""
    return f"postgresql://postgres@127.0.0.1:{free_port()}/payments"


async def raised(awaitable) -> BaseException:
    try:
        await awaitable
    except BaseException as exc:  # the exception is the subject of the test
        return exc
    raise AssertionError("expected an exception")


async def test_a_refused_connect_through_asyncpg_or_sqlalchemy_is_unavailable():
    url = nobody_listens()
    engine = create_async_engine(asyncpg_url(url))
    try:
        bare = await raised(asyncpg.connect(url))
        pooled = await raised(engine.connect().__aenter__())
    finally:
        await engine.dispose()

    # SQLAlchemy does not wrap it: a handler for its types alone would miss it.
    assert isinstance(bare, ConnectionRefusedError) and isinstance(pooled, ConnectionRefusedError)
    assert database_unavailable(bare) and database_unavailable(pooled)


async def test_a_refused_connect_that_is_not_the_databases_is_not_an_outage():
    exc = await raised(asyncio.open_connection("127.0.0.1", free_port()))

    assert isinstance(exc, ConnectionRefusedError)
    assert not database_unavailable(exc), "a refused PSP or a missing file is a bug, not our database"


async def test_a_backend_terminated_mid_statement_is_unavailable(server_url):
    engine = create_async_engine(asyncpg_url(server_url))
    admin = await asyncpg.connect(server_url)
    try:
        async with engine.connect() as conn:
            pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            sleeping = asyncio.create_task(raised(conn.execute(text("SELECT pg_sleep(10)"))))

            async def asleep() -> bool:
                return await admin.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND query LIKE 'SELECT pg_sleep%'", pid
                ) == 1

            while not await asleep():
                await asyncio.sleep(0.01)
            await admin.execute("SELECT pg_terminate_backend($1)", pid)
            exc = await sleeping
    finally:
        await admin.close()
        await engine.dispose()

    assert exc.connection_invalidated, "SQLAlchemy saw the disconnect"
    assert database_unavailable(exc)
    assert "AdminShutdownError" in describe(exc) or "ConnectionDoesNotExistError" in describe(exc)
    assert "SELECT" not in describe(exc), "the log line carries no SQL"


async def test_a_connection_closed_while_idle_is_unavailable_and_the_pool_recovers(server_url):
    engine = create_async_engine(asyncpg_url(server_url), pool_size=1, max_overflow=0)
    admin = await asyncpg.connect(server_url)
    try:
        async with engine.connect() as conn:
            pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        await admin.execute("SELECT pg_terminate_backend($1)", pid)

        async def select_one():
            async with engine.connect() as conn:
                return (await conn.execute(text("SELECT 1"))).scalar_one()

        exc = await raised(select_one())
        after = await select_one()
    finally:
        await admin.close()
        await engine.dispose()

    assert database_unavailable(exc)
    assert after == 1, "the pool dropped the dead connection and opened a new one"


async def test_no_free_connection_within_the_pools_timeout_is_unavailable(server_url):
    engine = create_async_engine(asyncpg_url(server_url), pool_size=1, max_overflow=0, pool_timeout=0.1)
    try:
        async with engine.connect():
            exc = await raised(engine.connect().__aenter__())
    finally:
        await engine.dispose()

    assert database_unavailable(exc)


async def test_the_server_refusing_new_connections_while_it_starts_or_stops_is_unavailable():
    assert database_unavailable(asyncpg.CannotConnectNowError("the database system is starting up"))


@pytest.mark.parametrize(
    "statement",
    [
        "SELEC 1",
        "CREATE TEMP TABLE t (x int PRIMARY KEY); INSERT INTO t VALUES (1), (1)",
        "SET statement_timeout = 10; SELECT pg_sleep(1)",
    ],
    ids=["syntax-error", "unique-violation", "statement-timeout"],
)
async def test_a_bad_statement_is_a_bug_not_an_outage(statement, server_url):
    engine = create_async_engine(asyncpg_url(server_url))
    try:
        async with engine.connect() as conn:
            exc = None
            for part in statement.split("; "):
                try:
                    await conn.execute(text(part))
                except Exception as e:  # the last part is the one that fails
                    exc = e
    finally:
        await engine.dispose()

    assert exc is not None
    assert not database_unavailable(exc)
