"""The one module that opens and commits transactions.

Every phase of a payment is a function `phase(conn, ...)` that issues its
statements and returns a value; it never begins, commits or rolls back.
`atomic` gives it a connection inside a transaction and commits only if the
function returns. Any exception, including a lost lease (`LeaseLost`), rolls
back everything the phase wrote, so a phase either happened completely,
together with its recovery point, or not at all. `one_statement` runs a phase
that is a single statement, which PostgreSQL makes atomic by itself.

Because the connection goes back to the pool when the phase returns, nothing
holds a transaction or a pooled connection while the engine waits on the PSP or
the rail: that is rule 3 of the design, enforced here by construction.

A phase is also bounded in time at the database (`_bounded`,
DB_PHASE_TIMEOUT_SECONDS): its statements and its commit, which in strict
synchronous replication waits for a standby that may never come
(docs/failover.md#when-both-standbys-are-gone). Reads (`read`) and the key
table's upkeep (`autocommit`, `maintenance`) are not: nothing they do waits
for a standby, and the reaper's and reconciliation's statements may rightly
take long.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Concatenate, ParamSpec, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.db.driver import driver_of

P = ParamSpec("P")
T = TypeVar("T")

log = logging.getLogger(__name__)

# The engine's execution option that carries DB_PHASE_TIMEOUT_SECONDS
# (app/db/engine.py sets it); an engine without it runs phases unbounded.
PHASE_TIMEOUT = "phase_timeout_seconds"


async def atomic(
    engine: AsyncEngine,
    phase: Callable[Concatenate[AsyncConnection, P], Awaitable[T]],
    *args: P.args,
    **kwargs: P.kwargs,
) -> T:
    """Run `phase` in one READ COMMITTED transaction; commit iff it returns. Bounded in time (`_bounded`)."""
    async with engine.connect() as conn:
        async with _bounded(engine, conn):
            async with conn.begin():
                return await phase(conn, *args, **kwargs)


async def maintenance(
    engine: AsyncEngine,
    work: Callable[Concatenate[AsyncConnection, P], Awaitable[T]],
    *args: P.args,
    **kwargs: P.kwargs,
) -> T:
    """`atomic` without the phase's time bound: for the key table's upkeep (app/workers/retention.py), whose
    statements may wait on locks and read whole partitions. Never for a phase of a payment."""
    async with engine.connect() as conn:
        async with conn.begin():
            return await work(conn, *args, **kwargs)


@asynccontextmanager
async def _bounded(engine: AsyncEngine, conn: AsyncConnection) -> AsyncIterator[None]:
    """Give up on `conn` if the block has not ended within the engine's PHASE_TIMEOUT: drop it, abruptly.

    The block's statements and its commit then fail as a lost connection
    (app/db/errors.py: a 503 with Retry-After, or the worker's backoff), and
    the pool discards the connection. The phase's outcome is whatever the
    database made durable, as after any lost connection.

    Dropped, never cancelled. A commit that waits for a synchronous standby
    has already been written on the primary; a cancel request
    (pg_cancel_backend, or asyncpg's own timeout or task cancellation, which
    sends one) ends that wait with a warning and leaves the commit visible
    there before any standby has it: the very commit a failover would lose.
    (A statement timeout does not end the wait at all.) Closing the socket
    sends nothing: the server goes on waiting, so the commit completes,
    replicated, once a standby is back, or never. That server must keep
    `client_connection_check_interval` at 0, its default, or it would notice
    the closed socket and cancel the wait itself.
    """
    seconds = engine.get_execution_options().get(PHASE_TIMEOUT)
    if seconds is None:
        yield
        return
    driver = await driver_of(conn)

    def drop() -> None:
        log.warning("a phase waited %s s at the database (DB_PHASE_TIMEOUT_SECONDS): its connection is dropped, "
                    "and the phase ends as if the database were lost", seconds)
        driver.terminate()  # asyncpg: abort the socket, no cancel request

    timer = asyncio.get_running_loop().call_later(seconds, drop)
    try:
        yield
    finally:
        timer.cancel()


async def one_statement(
    engine: AsyncEngine,
    phase: Callable[Concatenate[AsyncConnection, P], Awaitable[T]],
    *args: P.args,
    **kwargs: P.kwargs,
) -> T:
    """Run a phase that is a single SQL statement, without BEGIN and COMMIT.

    PostgreSQL runs a lone statement as a transaction of its own: it commits
    completely when the statement ends (deferred constraints are checked
    then), or not at all. So the statement is exactly as atomic as if it were
    wrapped in BEGIN and COMMIT, and costs one round trip instead of three.
    The phase must issue exactly one writing statement: a second one would
    commit separately. (It may read afterwards, as handler1 does to name the
    payment that already holds a reference.)
    """
    async with engine.connect() as conn:
        await _autocommit(conn)
        async with _bounded(engine, conn):
            return await phase(conn, *args, **kwargs)


async def _autocommit(conn: AsyncConnection) -> None:
    # Set on this connection, and undone when it goes back to the pool.
    # (`engine.execution_options(...)` would build a new engine, copying
    # its event listeners, on every call.)
    await conn.execution_options(isolation_level="AUTOCOMMIT")


async def _unbounded_statements(
    engine: AsyncEngine,
    work: Callable[Concatenate[AsyncConnection, P], Awaitable[T]],
    *args: P.args,
    **kwargs: P.kwargs,
) -> T:
    """Each statement of `work` on its own, as `one_statement`, without its time bound."""
    async with engine.connect() as conn:
        await _autocommit(conn)
        return await work(conn, *args, **kwargs)


async def autocommit(
    engine: AsyncEngine,
    work: Callable[Concatenate[AsyncConnection, P], Awaitable[T]],
    *args: P.args,
    **kwargs: P.kwargs,
) -> T:
    """Run maintenance in which every statement commits on its own (no transaction block).

    For the key table's partition upkeep (app/idempotency/partitions.py), whose
    statements are each complete in themselves and must not hold the locks of
    one across the next. Never for a phase of a payment: use `atomic` or
    `one_statement`. Not bounded in time: moving a day's live rows may take long.
    """
    return await _unbounded_statements(engine, work, *args, **kwargs)


async def read(
    engine: AsyncEngine,
    query: Callable[Concatenate[AsyncConnection, P], Awaitable[T]],
    *args: P.args,
    **kwargs: P.kwargs,
) -> T:
    """Run a read-only query: one SELECT, like `one_statement`, writing nothing.

    Not bounded in time: a read waits for no standby, and reconciliation's
    and the reaper's reads of a day's rows may rightly take long.
    """
    return await _unbounded_statements(engine, query, *args, **kwargs)
