"""The SQLAlchemy async engine (asyncpg underneath), built once per process."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from app.config import Settings


def build_engine(settings: Settings) -> AsyncEngine:
    return create_async_engine(
        settings.database_url,
        pool_size=settings.db_pool_size,
        max_overflow=0,
        pool_pre_ping=False,
        # Leases are compared with now() on the server, never with this
        # process's clock; UTC keeps the timestamps we print unambiguous.
        connect_args={"server_settings": {"timezone": "UTC"}},
    )


async def ping(conn) -> None:
    """A round trip to the database, for health checks."""
    from sqlalchemy import text

    await conn.execute(text("SELECT 1"))
