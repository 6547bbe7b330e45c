"""The HTTP client the PSP and rail clients share, and what its errors mean.

Where it sits: under app/rails/gateways.py, which speaks httpx's interface
over aiohttp's connections, joined by an adapter. `ClassifyingTransport`
corrects that adapter at the boundary, so the client only ever sees httpx's
exceptions, each meaning what httpx documents: a refused connection is
`httpx.ConnectError` (nothing was sent), never a connect timeout (after
which the call may have been applied), and an answer that is not HTTP is
`httpx.RemoteProtocolError`, never aiohttp's own exception.
docs/crash-matrix.md#unknown-outcomes-202-backoff-parking says why it matters.
An idle connection is given up before the server on the other end would
close it (KEEP_ALIVE_SECONDS).
"""

from __future__ import annotations

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

# A second shorter than the 5 s idle timeout of common servers (uvicorn's,
# the fakes' among them; nginx's is longer), so a kept-alive connection the
# PSP or the rail is about to close is never picked for a call. Equal to it
# (httpx's default, which the adapter hands to aiohttp), a call written just
# as the server closes is lost unanswered: an Unknown outcome for a charge
# the PSP never received, and a 202 where a 201 was due. (The webhook
# dispatcher's own client keeps the same margin: app/outbox/http1.py.)
KEEP_ALIVE_SECONDS = 4.0


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
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections // 2,
                          keepalive_expiry=KEEP_ALIVE_SECONDS)
    return httpx.AsyncClient(transport=ClassifyingTransport(limits=limits))
