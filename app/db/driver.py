"""A phase's lone statement sent to asyncpg itself, past SQLAlchemy's execution: an optimisation.

Where it sits: under `Statement.fetch_one` (app/machine/statements.py), which
every single-statement phase of an operation runs (the claim of a new
payment, and each record phase through app/machine/engine.py::fenced), and
under the webhook dispatcher's read and move of its cursor
(app/outbox/delivery.py: `take`, `move`), which run once per batch of first
attempts (`fetch_all`).
Such a statement is a transaction of its own on a connection that
`app.db.transaction.one_statement` checked out in AUTOCOMMIT: SQLAlchemy
would only pass the text and the parameters on, and read one row back. Here
asyncpg gets the same text, compiled once per statement by SQLAlchemy's own
compiler for the asyncpg dialect, and the same values in the same order, on
the same pooled connection; what the server runs, and how it plans it, is
unchanged. What is skipped is SQLAlchemy's execution context, its result
object and the greenlet hop around each statement (what it saves, measured:
docs/reference/performance.md#the-optimisations-behind-one-door).

It applies only where it cannot change what commits: on a connection in
AUTOCOMMIT, whose engine was built with DRIVER_STATEMENTS (app/db/engine.py:
on unless REPLAY_SHORTCUT=false, the switch of every optimisation). Inside a
transaction (`atomic`) SQLAlchemy runs the statement, since it is
SQLAlchemy that sends that transaction's BEGIN. The errors keep the shape
the service handles: a constraint's refusal is SQLAlchemy's IntegrityError,
as the claim expects; a lost connection or a read-only node also lets go of
the connection, as the engine's listeners do for SQLAlchemy's own
statements; anything else is the driver's error, as it would be inside
SQLAlchemy's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import asyncpg
from sqlalchemy import TextClause
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from app.db.errors import database_unavailable

# The engine's execution option that allows this path (app/db/engine.py).
DRIVER_STATEMENTS = "driver_statements"

_DIALECT = asyncpg_dialect()


@dataclass(frozen=True)
class Positional:
    """A statement as asyncpg takes it ($1, $2, ...) and its parameters' names in that order."""

    sql: str
    names: tuple[str, ...]

    @classmethod
    def of(cls, clause: TextClause) -> Positional:
        compiled = clause.compile(dialect=_DIALECT)
        return cls(compiled.string, tuple(compiled.positiontup or ()))


async def fetch_one(
    conn: AsyncConnection, clause: TextClause, positional: Positional, params: Mapping[str, Any]
) -> Mapping[str, Any] | None:
    """Run `clause` (compiled as `positional`) with `params` on `conn`: the one row it returns, or None."""
    rows = await _run(conn, clause, positional, params, one=True)
    return rows[0] if rows else None


async def fetch_all(
    conn: AsyncConnection, clause: TextClause, positional: Positional, params: Mapping[str, Any]
) -> list[Mapping[str, Any]]:
    """Run `clause` (compiled as `positional`) with `params` on `conn`: every row it returns.

    For the webhook dispatcher's reads and moves of its cursor
    (app/outbox/delivery.py), each a lone statement in AUTOCOMMIT too.
    """
    return await _run(conn, clause, positional, params, one=False)


async def driver_of(conn: AsyncConnection) -> asyncpg.Connection:
    """The asyncpg connection under `conn`, without a hop into SQLAlchemy's greenlet where none is needed.

    `get_raw_connection` always makes that hop, because an invalidated
    connection must connect again on the way, which is I/O. A connection that
    is checked out and valid holds its pooled connection as a plain attribute:
    reading it does no I/O, so it is read here directly. Each hop starts a new
    greenlet, which costs a system call to map the greenlet's own stack of
    Python frames and one to unmap it (an optimisation:
    docs/reference/performance.md#a-greenlet-per-await-2026-12-04).
    """
    sync = conn.sync_connection
    if sync is not None and not sync.closed and not sync.invalidated:
        return sync.connection.driver_connection
    return (await conn.get_raw_connection()).driver_connection


async def _run(conn: AsyncConnection, clause: TextClause, positional: Positional, params: Mapping[str, Any], *,
               one: bool) -> list[Mapping[str, Any]]:
    options = conn.sync_connection.get_execution_options()  # no I/O: the options it was given
    if not (options.get(DRIVER_STATEMENTS) and options.get("isolation_level") == "AUTOCOMMIT"):
        result = (await conn.execute(clause, dict(params))).mappings()
        if one:
            row = result.one_or_none()
            return [] if row is None else [row]
        return list(result.all())
    sql, names = positional.sql, positional.names
    driver = await driver_of(conn)
    values = [params[name] for name in names]
    try:
        rows = [await driver.fetchrow(sql, *values)] if one else await driver.fetch(sql, *values)
    except asyncpg.IntegrityConstraintViolationError as exc:
        # SQLSTATE class 23: what the claim reads as "the reference is
        # taken" or "no partition for today" (app/payments/phases.py,
        # app/machine/matrix.py). hide_parameters: customer data never
        # reaches an error's text.
        raise IntegrityError(sql, None, exc, hide_parameters=True) from exc
    except Exception as exc:
        if database_unavailable(exc):
            # Never hand this connection out again: it is lost, or it reached
            # a node that is not the primary (app/db/engine.py).
            await conn.invalidate(exc)
        raise
    except BaseException:
        # Cancelled mid-statement (a shutdown, a client gone): what the
        # connection is in the middle of is unknown, so it is closed, and the
        # pool replaces it at its next checkout (app/db/engine.py), as
        # SQLAlchemy does with a connection whose statement was cancelled.
        driver.terminate()
        raise
    return [dict(row.items()) for row in rows if row is not None]
