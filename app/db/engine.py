"""The database handle a process builds once: SQLAlchemy's engine, asyncpg underneath.

Everything the service reads and writes goes through it and
`app.db.transaction`, which lends its connections out one phase at a time.
The console's pages may read through a second one, on a standby
(`build_read_engine`, DATABASE_READ_URL); nothing else does.
(The replay shortcut's one read has a small pool of its own, behind the
door of optimisations: app/fastpath/lookup_pool.py.)
"""

from __future__ import annotations

from asyncpg import ReadOnlySQLTransactionError
from sqlalchemy import text
from sqlalchemy import event
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from app.config import Settings
from app.db.driver import DRIVER_STATEMENTS
from app.db.transaction import PHASE_TIMEOUT

# Leases are compared with now() on the server, never with this process's
# clock; UTC keeps the timestamps we print unambiguous.
#
# plan_cache_mode: every statement the service prepares is planned once and
# the plan reused, never planned again for each call's parameters. Left to
# choose, PostgreSQL compares the one plan for all parameters with plans made
# for each call's, and a statement that writes to one day's partition of the
# key table looks cheaper planned per call (that plan names one partition),
# so it was planned again on every call, which cost more than all its
# execution. The reused plan still skips the other days' partitions: it
# prunes them when it starts, from the parameter (an optimisation:
# docs/reference/performance.md, "One new payment in the database, statement
# by statement").
SERVER_SETTINGS = {"timezone": "UTC", "plan_cache_mode": "force_generic_plan"}


def build_engine(settings: Settings) -> AsyncEngine:
    """The engine of DATABASE_URL, the primary: every write, and every read on a payment's path.

    Its phases are bounded by DB_PHASE_TIMEOUT_SECONDS (app/db/transaction.py::_bounded), and a phase's
    lone statement goes to asyncpg itself (an optimisation, app/db/driver.py; off with every other one when
    REPLAY_SHORTCUT=false).
    """
    return _engine(settings.database_url, settings.db_pool_size, {
        PHASE_TIMEOUT: settings.db_phase_timeout_seconds, DRIVER_STATEMENTS: settings.replay_shortcut,
    })


def build_read_engine(settings: Settings) -> AsyncEngine | None:
    """The engine of DATABASE_READ_URL, which may be a standby; None if it is not set (read DATABASE_URL).

    Only the read model's queries use it (app/console/routes.py's pages):
    what it answers may be a moment old. A few connections, because a page
    is a person's click, not a client's traffic.
    """
    if settings.database_read_url is None:
        return None
    return _engine(settings.database_read_url, READ_POOL_SIZE, {})


READ_POOL_SIZE = 4


def _engine(url: str, pool_size: int, options: dict[str, float | bool]) -> AsyncEngine:
    engine = create_async_engine(
        url,
        execution_options=options,
        # A statement's parameters are card tokens, names, IBANs and API key
        # hashes; SQLAlchemy puts them into the text of every database error
        # ("[parameters: ...]"), which is then logged. Never.
        hide_parameters=True,
        pool_size=pool_size,
        max_overflow=0,
        # No ping per checkout (a round trip on every phase); a connection the
        # server closed is replaced at checkout instead, below.
        pool_pre_ping=False,
        connect_args={"server_settings": SERVER_SETTINGS},
    )
    install_listeners(engine)
    return engine


def install_listeners(engine: AsyncEngine) -> None:
    """What every engine of the service does with its connections: below."""
    event.listen(engine.sync_engine, "checkout", _replace_if_closed)
    event.listen(engine.sync_engine, "handle_error", _read_only_is_a_disconnect)


def _read_only_is_a_disconnect(context) -> None:
    """A write refused as read-only (SQLSTATE 25006) means this connection reached a node that is not the
    primary (a standby, or the old primary during a failover, docs/failover.md): treat it as a lost
    connection, so the pool discards it and every connection made before it, and the next ones are made
    anew, through whatever now routes to the primary. Never retried on the same connection."""
    exc = context.original_exception
    while exc is not None:  # the dialect wraps asyncpg's error; it is the cause
        if isinstance(exc, ReadOnlySQLTransactionError):
            context.is_disconnect = True
            return
        exc = exc.__cause__


def _replace_if_closed(dbapi_connection, connection_record, connection_proxy) -> None:
    """Hand out no pooled connection that the server has already closed.

    A restarted server, or `pg_terminate_backend`, closes every connection
    sitting idle in the pool, and asyncpg notices at once (the socket
    closes). Without this, the next phase to check one out would fail with
    "connection is closed" before sending anything: a payment released with
    a backoff, or a 503, for nothing. Raising DisconnectionError here makes
    the pool discard it and hand out a fresh one; asking costs no round trip.
    """
    if dbapi_connection.driver_connection.is_closed():
        raise DisconnectionError("the server closed this pooled connection while it was idle")


async def ping(conn: AsyncConnection) -> None:
    """A round trip to the database, for health checks."""
    await conn.execute(text("SELECT 1"))
