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
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Concatenate, ParamSpec, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

P = ParamSpec("P")
T = TypeVar("T")


async def atomic(
    engine: AsyncEngine,
    phase: Callable[Concatenate[AsyncConnection, P], Awaitable[T]],
    *args: P.args,
    **kwargs: P.kwargs,
) -> T:
    """Run `phase` in one READ COMMITTED transaction; commit iff it returns."""
    async with engine.connect() as conn:
        async with conn.begin():
            return await phase(conn, *args, **kwargs)


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
        # Set on this connection, and undone when it goes back to the pool.
        # (`engine.execution_options(...)` would build a new engine, copying
        # its event listeners, on every call.)
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        return await phase(conn, *args, **kwargs)


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
    `one_statement`.
    """
    return await one_statement(engine, work, *args, **kwargs)


async def read(
    engine: AsyncEngine,
    query: Callable[Concatenate[AsyncConnection, P], Awaitable[T]],
    *args: P.args,
    **kwargs: P.kwargs,
) -> T:
    """Run a read-only query: one SELECT, like `one_statement`, writing nothing."""
    return await one_statement(engine, query, *args, **kwargs)
