"""Telling an unreachable database from a bad statement, with the exceptions a real server raises.

Every exception here is provoked for real: a connect to a port nobody listens
on, a backend killed with pg_terminate_backend, a pool with no free
connection, a syntax error, a duplicate key, a statement timeout. The
exceptions are CannotConnectNowError ("the database system is starting up"),
which needs a server caught mid-start, and a connection used in the instant
the server says goodbye; both are built by hand here, and the outage test
(test_database_outage.py) meets them for real. Then the API, on a database that
is not there: every path answers 503 problem+json, never 500.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncpg
import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from app.config import Settings, asyncpg_url
from app.db.engine import build_engine, install_listeners
from app.db.errors import database_unavailable, describe
from app.db.transaction import atomic, autocommit, maintenance, one_statement, read
from app.main import create_app
from devtools.processes import free_port
from tests.support import payment_body


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


async def test_a_pooled_connection_used_as_the_server_says_goodbye_is_unavailable_but_misuse_is_a_bug():
    # Both messages as asyncpg's protocol words them; the first was met for
    # real by the outage test (the lookup pool, during pg_ctl stop -m fast).
    farewell = asyncpg.InternalClientError("cannot switch to state 12; another operation (2) is in progress")
    misuse = asyncpg.InternalClientError("cannot switch to state 12; another operation (15) is in progress")

    assert database_unavailable(farewell)
    assert not database_unavailable(misuse)


async def test_a_phase_past_its_bound_is_dropped_not_cancelled_but_reads_and_upkeep_are_not_bounded(server_url):
    """Catches: a phase left waiting at the database without end (a commit for a synchronous standby that never
    comes), a bound enforced with a cancel request (which makes such a commit visible on the primary before any
    standby has it: docs/failover.md), and a bound that cuts reconciliation's or the reaper's long statements."""
    bound = 0.5
    engine = build_engine(Settings(database_url=server_url, db_phase_timeout_seconds=bound, db_pool_size=1))

    async def sleep(conn, seconds: float) -> int:
        # pg_sleep stands for any wait at the server: a lock, or a commit waiting for a standby.
        return (await conn.execute(text(f"SELECT pg_backend_pid(), pg_sleep({seconds})"))).first()[0]

    watcher = await asyncpg.connect(server_url)
    try:
        for unbounded in (read, autocommit, maintenance):
            await unbounded(engine, sleep, bound * 2)
        pid = await read(engine, sleep, 0)
        for phase in (atomic, one_statement):
            started = time.monotonic()
            dropped = await raised(phase(engine, sleep, 30))
            assert time.monotonic() - started < bound + 1.5, "given up on at the bound"
            assert database_unavailable(dropped), describe(dropped)
            # Dropped, not cancelled: the server still runs what it was given (a cancel request would have
            # ended the sleep, as it would have ended a commit's wait for its standby, leaving the commit).
            assert await watcher.fetchval(
                "SELECT state FROM pg_stat_activity WHERE pid = $1 AND query LIKE '%pg_sleep(30)%'", pid) == "active"
            await watcher.execute("SELECT pg_terminate_backend($1)", pid)
            assert (new_pid := await read(engine, sleep, 0)) != pid, "the pool let go of the dropped connection"
            pid = new_pid
    finally:
        await watcher.close()
        await engine.dispose()


async def test_a_standby_cancelling_a_read_for_its_replay_is_unavailable_but_another_serialization_failure_is_not():
    """Catches: a console page whose read a standby cancelled for its replay answered as a bug's 500."""
    # As a standby words it when the WAL it replays removes rows a page's read
    # (DATABASE_READ_URL) could still see; built by hand: make test runs no standby.
    assert database_unavailable(asyncpg.SerializationError("canceling statement due to conflict with recovery"))
    assert not database_unavailable(asyncpg.SerializationError("could not serialize access due to concurrent update"))


async def test_a_write_on_a_read_only_node_is_unavailable_and_the_pool_lets_go_of_the_connection(server_url):
    # What a standby, or a primary being demoted in a failover, answers a write
    # (docs/failover.md): SQLSTATE 25006. A read-only session gets the same
    # answer from this one server, so no second node is needed.
    engine = create_async_engine(asyncpg_url(server_url), pool_size=1, max_overflow=0)
    install_listeners(engine)
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SET default_transaction_read_only = on"))
            await conn.commit()
            pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            refused = await raised(conn.execute(text("CREATE TEMP TABLE written (x int)")))
        bare = await asyncpg.connect(server_url, server_settings={"default_transaction_read_only": "on"})
        try:
            refused_bare = await raised(bare.execute("CREATE TEMP TABLE written (x int)"))
        finally:
            await bare.close()

        assert getattr(refused.orig, "sqlstate", None) == "25006" and refused_bare.sqlstate == "25006"
        assert database_unavailable(refused) and database_unavailable(refused_bare)
        # Never used for a write again: the pool made a new connection.
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one() != pid
            assert (await conn.execute(text("SHOW transaction_read_only"))).scalar_one() == "off"
    finally:
        await engine.dispose()


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


@pytest.fixture
async def api_without_database():
    """The real app, started (lifespan) against a database that is not there, called in-process."""
    app = create_app(Settings(database_url=nobody_listens()))
    async with app.router.lifespan_context(app):
        # raise_app_exceptions: an exception escaping the app fails the test
        # instead of being turned into a 500 by the transport.
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            yield client


def assert_service_unavailable(response: httpx.Response) -> dict:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert int(response.headers["Retry-After"]) >= 1
    problem = response.json()
    assert problem["type"] == "/problems/service-unavailable" and problem["status"] == 503
    return problem


async def test_a_payment_whose_first_read_cannot_reach_the_database_is_a_503_from_the_replay_shortcut(
    api_without_database,
):
    # A complete, valid POST: the replay shortcut makes its read before routing.
    response = await api_without_database.post(
        "/v1/payments", json=payment_body(),
        headers={"Authorization": "Bearer some-api-key", "Idempotency-Key": str(uuid.uuid4())},
    )

    assert_service_unavailable(response)


async def test_a_route_that_cannot_reach_the_database_is_a_503_not_a_500(api_without_database):
    response = await api_without_database.get(
        f"/v1/payments/{uuid.uuid4()}", headers={"Authorization": "Bearer some-api-key"}
    )

    assert_service_unavailable(response)


async def test_healthz_names_the_database_as_the_dependency_that_is_down(api_without_database):
    response = await api_without_database.get("/healthz")

    assert assert_service_unavailable(response)["checks"] == {"database": "down"}
