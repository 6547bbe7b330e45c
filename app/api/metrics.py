"""Request metrics, and /metrics for Prometheus to scrape.

Where it sits: `RequestMetrics` is the outermost of our middlewares
(app/main.py), so it times every answer, those given before routing too (a
413 from the body cap, a replay from the shortcut, a 503 when the database
is away), and records it by route template, method and status in
HTTP_REQUESTS (app/observability/metrics.py). docs/operations.md#every-metric
says how the route label stays bounded, and which answers never reach here.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import APIRouter, Response

from app.observability import metrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

UNMATCHED = "unmatched"
# A route without parameters is its own template: a request answered before
# routing (the replay shortcut, the body cap) is labelled with it.
_STATIC_ROUTES = frozenset({"/v1/payments", "/healthz", "/metrics", "/openapi.json", "/docs", "/redoc"})
# The method is the client's to choose: any other is `other`, or a client
# could make a new series with every request.
_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def scrape() -> Response:
    """Every metric of this API, added up over all its worker processes (docs/operations.md)."""
    return Response(metrics.exposition(), media_type=metrics.CONTENT_TYPE)


class RequestMetrics:
    """ASGI middleware: each HTTP request, timed and counted by route template, method and status."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # if the application raises before answering, the server answers 500

        # Not a coroutine of its own: it hands back `send`'s, which the
        # caller awaits, so each message costs no extra coroutine.
        def sent(message: Message) -> Awaitable[None]:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            return send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or (scope["path"] if scope["path"] in _STATIC_ROUTES else UNMATCHED)
            method = scope["method"] if scope["method"] in _METHODS else "other"
            metrics.request_timer(template, method, status).observe(time.perf_counter() - started)
