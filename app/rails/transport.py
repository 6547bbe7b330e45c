"""The HTTP client the PSP and rail clients share, and what its errors mean.

We speak httpx's interface over aiohttp's connection handling (httpx's own
transport costs far more CPU per call: docs/reference/performance.md). The
adapter that joins them maps aiohttp's exceptions onto httpx's, but it maps a refused
connection to `httpx.ConnectTimeout`, and lets an answer that is not HTTP at
all escape as aiohttp's own `ClientResponseError`. Both matter for money:

- a refused connection (or a name that does not resolve) means not a byte of
  the request left this process, so the call is certainly *not applied* and
  may be sent again, even to a rail that cannot deduplicate. It must be told
  apart from a timeout, after which the call may well have been applied;
- an answer that is not HTTP (a proxy's garbage, a wrong port) must be an
  ordinary transport error, so that it is classified like any other broken
  exchange (unknown) instead of escaping as an unexpected exception.

`ClassifyingTransport` fixes both at the boundary, so app/rails/gateways.py
only ever sees httpx's exceptions, each meaning what httpx documents.
"""

from __future__ import annotations

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport


class ClassifyingTransport(AiohttpTransport):
    """aiohttp underneath, httpx's exceptions on top, each with its documented meaning."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except httpx.TransportError as exc:
            cause = exc.__cause__
            if isinstance(cause, aiohttp.ClientConnectorError):
                # Raised while connecting (refused, unreachable, no such
                # host): the request was never written.
                raise httpx.ConnectError(f"cannot connect: {cause.os_error}", request=request) from cause
            if isinstance(cause, aiohttp.ServerDisconnectedError):
                # The request was written, then the server hung up without an
                # answer: it may have acted on it.
                raise httpx.RemoteProtocolError("server disconnected without an answer", request=request) from cause
            raise
        except aiohttp.ClientError as exc:
            # Not mapped by the adapter, e.g. a response that is not HTTP.
            raise httpx.RemoteProtocolError(f"not an HTTP answer ({type(exc).__name__})", request=request) from exc


def http_client(*, max_connections: int = 200) -> httpx.AsyncClient:
    """The client the service uses in production (and the unit tests use too)."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections // 2)
    return httpx.AsyncClient(transport=ClassifyingTransport(limits=limits))
