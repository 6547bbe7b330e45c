"""The replay shortcut's one read, on asyncpg itself, from a small pool of its own.

Where it sits on a request's path: the replay shortcut (replay_shortcut.py)
calls `LookupPool.look_up` before FastAPI runs. It is the same statement the
full path reads (`app.authentication.payment_caller`: CALLER_SQL), run on the
driver without SQLAlchemy's execution machinery around it. It is a single
SELECT: no transaction, nothing to commit, and the connection is back in the
pool when it returns.
"""

from __future__ import annotations

import json
from types import TracebackType

import asyncpg

from app.authentication import CallerLookup, caller_of
from app.client_accounts import hash_api_key
from app.config import Settings, libpq_url
from app.db.engine import SERVER_SETTINGS
from app.idempotency.key_table import CALLER_SQL


class LookupPool:
    """An asyncpg pool for the caller lookup, opened and closed with the API's lifespan.

    Connections open on first use, so an API that is never sent a payment
    opens none.
    """

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self.pool: asyncpg.Pool | None = None  # open between __aenter__ and __aexit__

    async def __aenter__(self) -> LookupPool:
        self.pool = await asyncpg.create_pool(
            libpq_url(self._settings.database_url),
            min_size=0,
            max_size=self._settings.db_lookup_pool_size,
            server_settings=SERVER_SETTINGS,
            init=_decode_jsonb,
            reset=_nothing_to_reset,
        )
        return self

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self.pool is not None:
            await self.pool.close()

    async def look_up(self, api_key: str, key: str) -> CallerLookup:
        assert self.pool is not None, "the lookup pool is opened by the API's lifespan"
        row = await self.pool.fetchrow(CALLER_SQL, hash_api_key(api_key), key)
        return CallerLookup(api_key, key, caller_of(row, key))


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
