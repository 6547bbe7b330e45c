"""Alembic environment: migrations are the only thing that creates the schema.

The URL comes from the same settings as the service (DATABASE_URL), or from
`config.attributes["database_url"]` when a program (the CLI, the test harness)
runs migrations itself.
"""

import asyncio

from alembic import context
from sqlalchemy.ext.asyncio import create_async_engine

from app.config import asyncpg_url


def _database_url() -> str:
    url = context.config.attributes.get("database_url")
    if url is None:
        from app.config import Settings

        url = Settings().database_url
    return asyncpg_url(url)


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=None)
    with context.begin_transaction():
        context.run_migrations()


async def _main() -> None:
    engine = create_async_engine(_database_url())
    async with engine.connect() as conn:
        await conn.run_sync(_run)
        await conn.commit()
    await engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported")
asyncio.run(_main())
