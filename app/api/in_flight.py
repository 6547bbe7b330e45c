"""Requests in flight, so that a stopping API gives back the leases it cannot finish.

Where it sits: `TrackInFlight` is an ASGI middleware (app/main.py) that keeps
every HTTP request's task in `InFlight.tasks` while it runs; the lifespan's
shutdown waits for them (`InFlight.settle`, at most RELEASE_SECONDS) before
it closes the database, so a payment uvicorn cancelled commits its release
first. docs/reference/http-edge.md#stopping-requests-in-flight explains why
uvicorn's own graceful shutdown is not enough.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]

# A release is one short transaction; this bounds how long a stopping API
# waits for them after SHUTDOWN_GRACE_SECONDS (with the database away, each
# gives up by itself and its lease simply expires).
RELEASE_SECONDS = 5.0


class InFlight:
    """The tasks of the HTTP requests this process is serving right now."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task] = set()

    async def settle(self, timeout: float = RELEASE_SECONDS) -> None:
        """Wait (at most `timeout`) until every request in flight has ended, cancelled or not."""
        pending = {t for t in self.tasks if t is not asyncio.current_task()}
        if not pending:
            return
        _, late = await asyncio.wait(pending, timeout=timeout)
        if late:
            log.warning("%d request(s) still running after %.0f s; their leases will expire", len(late), timeout)


class TrackInFlight:
    """ASGI middleware: keeps each HTTP request's task in `in_flight.tasks` while it runs."""

    def __init__(self, app: ASGIApp, in_flight: InFlight) -> None:
        self.app = app
        self.in_flight = in_flight

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        task = asyncio.current_task()
        assert task is not None
        self.in_flight.tasks.add(task)
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight.tasks.discard(task)
