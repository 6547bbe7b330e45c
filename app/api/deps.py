"""Request dependencies: the services, the authenticated client, the key header.

FastAPI solves these before it validates the body, so a well-formed request
is checked in the order a careful reader would: who is asking (401), under
which key (400), then what they ask for (400). (Bytes that are not JSON at all
are refused with 400 while FastAPI reads the body, before any of these.) Each
refusal happens before anything is stored.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app import clients
from app.db.transaction import read
from app.idempotency.keys import MAX_KEY_LENGTH, InvalidIdempotencyKey, parse_idempotency_key
from app.services import Services
from app.problems import IDEMPOTENCY_KEY_INVALID, IDEMPOTENCY_KEY_MISSING, UNAUTHENTICATED, ProblemError

_bearer = HTTPBearer(auto_error=False, description="The API key from `payments clients create NAME`.")


def get_services(request: Request) -> Services:
    return request.app.state.services


async def authenticated_client(
    services: Annotated[Services, Depends(get_services)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> int:
    """The caller's client id; 401 (and nothing stored) if the API key is missing or unknown."""
    api_key = credentials.credentials if credentials else ""
    client_id = None
    if 0 < len(api_key) <= 200:
        client_id = await read(services.engine, clients.authenticate, api_key)
    if client_id is None:
        raise ProblemError(
            UNAUTHENTICATED,
            "send Authorization: Bearer <api key>",
            headers={"WWW-Authenticate": 'Bearer realm="payments"'},
        )
    return client_id


async def idempotency_key(
    raw: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            description=(
                "Generate once per payment (a UUID v4 or v7 is ideal), store it with the pending "
                "payment, and send the same value on every retry. 1 to "
                f"{MAX_KEY_LENGTH} characters from A-Z a-z 0-9 _ . : ~ + / = -, bare or as a "
                'quoted structured-field string ("...").'
            ),
            examples=["8e03978e-40d5-43e8-bc93-6894a57f9324"],
        ),
    ] = None,
) -> str:
    if raw is None:
        raise ProblemError(IDEMPOTENCY_KEY_MISSING, "this request needs an Idempotency-Key header")
    try:
        return parse_idempotency_key(raw)
    except InvalidIdempotencyKey as exc:
        raise ProblemError(IDEMPOTENCY_KEY_INVALID, str(exc)) from None


ServicesDep = Annotated[Services, Depends(get_services)]
ClientId = Annotated[int, Depends(authenticated_client)]
IdempotencyKey = Annotated[str, Depends(idempotency_key)]
