"""The long-lived things a process needs: settings, the database, the rail clients.

Built once per process: by `create_app` for the API, by `payments worker` for
the recovery worker. Both then drive payments through the same engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.db.engine import build_engine, build_read_engine, ping
from app.db.transaction import read
from app.rails.gateways import PSP, Rail
from app.rails.transport import http_client


@dataclass(frozen=True)
class Services:
    settings: Settings
    engine: AsyncEngine  # the primary: every write, and every read a payment or a console session depends on
    psp: PSP
    rail: Rail
    # What the console's pages read through (app/readmodel): DATABASE_READ_URL,
    # perhaps a standby a moment behind, else `engine` itself. Never for a
    # payment's path or a console session: a client must read its own writes,
    # and a logout must end the session at once.
    pages_engine: AsyncEngine | None = None

    @property
    def read_model(self) -> AsyncEngine:
        """The engine the read model's queries run on (may be stale: docs/failover.md#reads-on-a-standby)."""
        return self.pages_engine or self.engine


@asynccontextmanager
async def open_services(settings: Settings) -> AsyncIterator[Services]:
    engine = build_engine(settings)
    pages_engine = build_read_engine(settings)
    try:
        # httpx's interface over aiohttp's connection handling, with each
        # error meaning what httpx says it means (app/rails/transport.py).
        async with http_client() as http:
            yield Services(
                settings=settings,
                engine=engine,
                pages_engine=pages_engine,
                psp=PSP(http, settings.psp_url, settings.psp_timeout_seconds, settings.transient_retries),
                rail=Rail(
                    http, settings.rail_url, settings.rail_timeout_seconds, settings.transient_retries,
                    legacy=settings.rail_legacy, legacy_accounts=settings.legacy_accounts,
                ),
            )
    finally:
        await engine.dispose()
        if pages_engine is not None:
            await pages_engine.dispose()


async def database_answers(services: Services) -> None:
    """One `SELECT 1`; raises whatever stops the database from answering (the health check's probe)."""
    await read(services.engine, ping)
