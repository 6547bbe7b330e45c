"""The one module that opens and commits transactions.

Every phase of a payment is a function `phase(conn, ...)` that issues its
statements and returns a value; it never begins, commits or rolls back.
`atomic` gives it a connection inside a transaction and commits only if the
function returns. Any exception, including a lost lease (`LeaseLost`), rolls
back everything the phase wrote, so a phase either happened completely,
together with its recovery point, or not at all.

Because the connection goes back to the pool when the phase returns, nothing
holds a transaction or a pooled connection while the runner waits on the PSP or
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


async def read(
    engine: AsyncEngine,
    query: Callable[Concatenate[AsyncConnection, P], Awaitable[T]],
    *args: P.args,
    **kwargs: P.kwargs,
) -> T:
    """Run a read-only query outside any explicit transaction.

    One SELECT is atomic on its own; without BEGIN and COMMIT it is one round
    trip to the database instead of three. (It must not write: nothing here
    would roll a write back.)
    """
    async with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        return await query(conn, *args, **kwargs)
