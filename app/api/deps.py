"""Request dependencies: the services, the authenticated client, the key header.

FastAPI solves these before it validates the body, so a well-formed request
is checked in the order a careful reader would: who is asking (401), under
which key (400), then what they ask for (400). (Bytes that are not JSON at all
are refused with 400 while FastAPI reads the body, before any of these.) Each
refusal happens before anything is stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param

from app import clients
from app.db.transaction import read
from app.idempotency import store as keys
from app.idempotency.store import KeyRow
from app.idempotency.keys import MAX_KEY_LENGTH, InvalidIdempotencyKey, parse_idempotency_key
from app.services import Services
from app.problems import IDEMPOTENCY_KEY_INVALID, IDEMPOTENCY_KEY_MISSING, UNAUTHENTICATED, ProblemError

_bearer = HTTPBearer(auto_error=False, description="The API key from `payments clients create NAME`.")
_KEY_HEADER = Header(
    alias="Idempotency-Key",
    description=(
        "Generate once per payment (a UUID v4 or v7 is ideal), store it with the pending "
        "payment, and send the same value on every retry. 1 to "
        f"{MAX_KEY_LENGTH} characters from A-Z a-z 0-9 _ . : ~ + / = -, bare or as a "
        'quoted structured-field string ("...").'
    ),
    examples=["8e03978e-40d5-43e8-bc93-6894a57f9324"],
)


async def get_services(request: Request) -> Services:
    # async, though it awaits nothing: FastAPI runs a plain `def` dependency
    # in a thread pool, a thread hand-off on every request for one attribute.
    return request.app.state.services


MAX_API_KEY_LENGTH = 200  # ours are 43; refusing longer ones early keeps hashing cheap


def bearer_api_key(authorization: str | None) -> str | None:
    """The API key in an `Authorization` header's value, or None.

    Parsed by the function FastAPI's HTTPBearer uses (the scheme "Bearer" in
    any case, the key after the first space, stripped), for the replay
    shortcut, which runs before FastAPI does.
    """
    scheme, api_key = get_authorization_scheme_param(authorization)
    return _usable(api_key) if scheme.lower() == "bearer" else None


def _api_key(credentials: HTTPAuthorizationCredentials | None) -> str | None:
    return _usable(credentials.credentials) if credentials else None


def _usable(api_key: str) -> str | None:
    return api_key if 0 < len(api_key) <= MAX_API_KEY_LENGTH else None


def _unauthenticated() -> ProblemError:
    return ProblemError(
        UNAUTHENTICATED,
        "send Authorization: Bearer <api key>",
        headers={"WWW-Authenticate": 'Bearer realm="payments"'},
    )


async def authenticated_client(
    services: Annotated[Services, Depends(get_services)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> int:
    """The caller's client id; 401 (and nothing stored) if the API key is missing or unknown."""
    api_key = _api_key(credentials)
    client_id = api_key and await read(services.engine, clients.authenticate, api_key)
    if not client_id:
        raise _unauthenticated()
    return client_id


@dataclass(frozen=True)
class PaymentCaller:
    """Who sent a POST /v1/payments, under which key, and what that key already holds."""

    client_id: int
    key: str
    row: KeyRow | None


async def payment_caller(
    request: Request,
    services: Annotated[Services, Depends(get_services)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    raw_key: Annotated[str | None, _KEY_HEADER] = None,
) -> PaymentCaller:
    """Authenticate and read the key's row in one query (401, then 400, as for any request).

    The same answers as `authenticated_client` followed by `idempotency_key`,
    in one round trip: a retry of a finished payment needs nothing else. The
    replay shortcut has usually made that read already and handed it over.
    """
    try:
        key = idempotency_key(raw_key)
    except ProblemError:
        await authenticated_client(services, credentials)  # who is asking comes first (401)
        raise
    api_key = _api_key(credentials)
    if not api_key:
        raise _unauthenticated()
    found = (_handed_over(request, api_key, key) or await look_up(services, api_key, key)).caller
    if found is None:
        raise _unauthenticated()
    return PaymentCaller(found.client_id, key, found.row)


@dataclass(frozen=True)
class Lookup:
    """The caller lookup for one request: which API key and key were looked up, and what was found."""

    api_key: str
    key: str
    caller: keys.Caller | None  # None: no client has this API key


async def look_up(services: Services, api_key: str, key: str) -> Lookup:
    """The caller lookup: one read (`store.load_caller`), kept with the API key and key it was made for."""
    return Lookup(api_key, key, await keys.load_caller(services.lookups, clients.hash_api_key(api_key), key))


# The replay shortcut (app/api/replay_shortcut.py) makes the caller lookup
# before FastAPI runs. When it cannot answer the request itself, it leaves
# what it read in the request's state, so the read is not made twice.
_LOOKUP = "caller_lookup"


def hand_over(scope: dict, lookup: Lookup) -> None:
    scope.setdefault("state", {})[_LOOKUP] = lookup


def _handed_over(request: Request, api_key: str, key: str) -> Lookup | None:
    lookup = request.scope.get("state", {}).get(_LOOKUP)
    # Used only for the very API key and key this request carries.
    return lookup if lookup is not None and (lookup.api_key, lookup.key) == (api_key, key) else None


def idempotency_key(raw: str | None) -> str:
    if raw is None:
        raise ProblemError(IDEMPOTENCY_KEY_MISSING, "this request needs an Idempotency-Key header")
    try:
        return parse_idempotency_key(raw)
    except InvalidIdempotencyKey as exc:
        raise ProblemError(IDEMPOTENCY_KEY_INVALID, str(exc)) from None


ServicesDep = Annotated[Services, Depends(get_services)]
ClientId = Annotated[int, Depends(authenticated_client)]
Caller = Annotated[PaymentCaller, Depends(payment_caller)]
