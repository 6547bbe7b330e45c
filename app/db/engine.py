"""The database handles a process builds once: SQLAlchemy's engine, and a small asyncpg pool.

Everything the service writes, and every read but one, goes through the
SQLAlchemy engine (asyncpg underneath) and `app.db.transaction`. The one
exception is the read that starts every `POST /v1/payments`: who is asking,
and what they stored under this key (`app.idempotency.store.load_caller`).
A retry of a finished payment is answered from that read alone, so its cost
is the cost of a replay; run on asyncpg directly it takes well under half the
CPU that SQLAlchemy's execution machinery adds around it
(docs/reference/performance.md). It is a single SELECT: no transaction, nothing to
commit, and the connection is back in the pool when it returns.
"""

from __future__ import annotations

import json

import asyncpg
from sqlalchemy import text
from sqlalchemy import event
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from app.config import Settings, libpq_url

# Leases are compared with now() on the server, never with this process's
# clock; UTC keeps the timestamps we print unambiguous.
_SERVER_SETTINGS = {"timezone": "UTC"}


def build_engine(settings: Settings) -> AsyncEngine:
    engine = create_async_engine(
        settings.database_url,
        # A statement's parameters are card tokens, names, IBANs and API key
        # hashes; SQLAlchemy puts them into the text of every database error
        # ("[parameters: ...]"), which is then logged. Never.
        hide_parameters=True,
        pool_size=settings.db_pool_size,
        max_overflow=0,
        # No ping per checkout (a round trip on every phase); a connection the
        # server closed is replaced at checkout instead, below.
        pool_pre_ping=False,
        connect_args={"server_settings": _SERVER_SETTINGS},
    )
    event.listen(engine.sync_engine, "checkout", _replace_if_closed)
    return engine


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


async def open_lookup_pool(settings: Settings) -> asyncpg.Pool:
    """The pool for the caller lookup. Connections open on first use, so a process
    that never serves a payment (the recovery worker) never opens one."""
    return await asyncpg.create_pool(
        libpq_url(settings.database_url),
        min_size=0,
        max_size=settings.db_lookup_pool_size,
        server_settings=_SERVER_SETTINGS,
        init=_decode_jsonb,
        reset=_nothing_to_reset,
    )


async def _decode_jsonb(conn: asyncpg.Connection) -> None:
    # SQLAlchemy's dialect decodes jsonb into Python values; so must this pool,
    # so that a row read either way is the same row (the key's timeline).
    await conn.set_type_codec("jsonb", schema="pg_catalog", encoder=json.dumps, decoder=json.loads)


async def _nothing_to_reset(conn: asyncpg.Connection) -> None:
    """Skip asyncpg's reset query when a connection goes back to the pool.

    By default every release sends `SELECT pg_advisory_unlock_all(); CLOSE ALL;
    UNLISTEN *; RESET ALL`: a second round trip, and a second transaction, for
    each lookup. The lookup is one SELECT: it takes no lock, opens no cursor,
    listens to nothing and sets nothing, so there is nothing to reset. (asyncpg
    still rolls back a transaction left open, before calling this.)
    """


async def ping(conn: AsyncConnection) -> None:
    """A round trip to the database, for health checks."""
    await conn.execute(text("SELECT 1"))
