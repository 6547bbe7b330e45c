"""A pooled connection the server closed while it sat idle is replaced, not handed out.

A restarted PostgreSQL, or `pg_terminate_backend`, closes the connections
idling in the API's pool. The next phase to check one out would fail with
"connection is closed" before sending anything, so a payment that could
simply go on would be released with a backoff, or answered 503, for nothing.
app/db/engine.py::_replace_if_closed replaces such a connection at checkout.
"""

from __future__ import annotations

import pytest
from sqlalchemy import text

from app.config import Settings
from app.db.engine import build_engine
from tests.support import until


@pytest.fixture
async def engine(database_url):
    engine = build_engine(Settings(database_url=database_url, db_pool_size=1))
    yield engine
    await engine.dispose()


def _idle_connection_closed(engine) -> bool:
    """Whether the one connection idling in the pool is known, client-side, to be closed."""
    idle = list(engine.sync_engine.pool._pool._queue._queue)  # the idle records, oldest first
    return bool(idle) and idle[0].dbapi_connection.driver_connection.is_closed()


async def test_a_connection_the_server_closed_while_idle_is_replaced_at_checkout(engine, db):
    async with engine.connect() as conn:
        pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()

    assert await db.fetchval("SELECT pg_terminate_backend($1)", pid)

    async def noticed() -> bool:
        return _idle_connection_closed(engine)

    await until(noticed, "the pool's connection to be seen closed")
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one() != pid
