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

from app import authentication
from app.authentication import CallerLookup, PaymentCaller
from app.idempotency.keys import MAX_KEY_LENGTH, InvalidIdempotencyKey, parse_idempotency_key
from app.services import Services
from app.problems import IDEMPOTENCY_KEY_INVALID, IDEMPOTENCY_KEY_MISSING, UNAUTHENTICATED, ProblemError

_bearer = HTTPBearer(auto_error=False, description="The API key from `payments clients create NAME`.")
_KEY_HEADER = Header(
    alias="Idempotency-Key",
    description=(
        "Generate once per operation, a payment or a refund (a UUID v4 or v7 is ideal), store it "
        "with what it is for, and send the same value on every retry. 1 to "
        f"{MAX_KEY_LENGTH} characters from A-Z a-z 0-9 _ . : ~ + / = -, bare or as a "
        'quoted structured-field string ("...").'
    ),
    examples=["8e03978e-40d5-43e8-bc93-6894a57f9324"],
)


async def get_services(request: Request) -> Services:
    # async, though it awaits nothing: FastAPI runs a plain `def` dependency
    # in a thread pool, a thread hand-off on every request for one attribute.
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
RawKey = Annotated[str | None, _KEY_HEADER]


MAX_API_KEY_LENGTH = 200  # well above ours (app/client_accounts.py::new_api_key); refusing longer ones early keeps hashing cheap


def usable_api_key(api_key: str | None) -> str | None:
    """The API key as sent, if it can be one at all (not empty, not absurdly long)."""
    return api_key if api_key and len(api_key) <= MAX_API_KEY_LENGTH else None


def api_key_of(credentials: HTTPAuthorizationCredentials | None) -> str | None:
    return usable_api_key(credentials.credentials) if credentials else None


def unauthenticated() -> ProblemError:
    return ProblemError(
        UNAUTHENTICATED,
        "send Authorization: Bearer <api key>",
        headers={"WWW-Authenticate": 'Bearer realm="payments"'},
    )


async def authenticated_client(services: ServicesDep, credentials: Credentials) -> int:
    """The caller's client id; 401 (and nothing stored) if the API key is missing or unknown."""
    api_key = api_key_of(credentials)
    client_id = api_key and await authentication.client_id(services, api_key)
    if not client_id:
        raise unauthenticated()
    return client_id


# Where a layer in front of the routes (the replay shortcut, app/fastpath/)
# leaves the caller lookup it already made, in the request's state.
HANDED_OVER = "caller_lookup"


async def payment_caller(
    request: Request, services: ServicesDep, credentials: Credentials, raw_key: RawKey = None
) -> PaymentCaller:
    """Authenticate and read the key's row in one query (401, then 400, as for any request).

    The same answers as `authenticated_client` followed by `idempotency_key`,
    in one round trip: a retry of a finished payment needs nothing else. If
    the replay shortcut already made this very lookup, it is used instead of
    reading again.
    """
    lookup = handed_over(request, api_key_of(credentials), raw_key)
    if lookup is not None:
        if lookup.caller is None:
            raise unauthenticated()
        return lookup.caller
    try:
        key = idempotency_key(raw_key)
    except ProblemError:
        await authenticated_client(services, credentials)  # who is asking comes first (401)
        raise
    api_key = api_key_of(credentials)
    caller = api_key and await authentication.payment_caller(services, api_key, key)
    if not caller:
        raise unauthenticated()
    return caller


def handed_over(request: Request, api_key: str | None, raw_key: str | None) -> CallerLookup | None:
    """The lookup left in the request's state, only if it was made for the very API key and key it carries."""
    lookup = request.scope.get("state", {}).get(HANDED_OVER)
    if lookup is None or api_key != lookup.api_key or raw_key is None:
        return None
    try:
        return lookup if parse_idempotency_key(raw_key) == lookup.key else None
    except InvalidIdempotencyKey:
        return None


def idempotency_key(raw: str | None) -> str:
    if raw is None:
        raise ProblemError(IDEMPOTENCY_KEY_MISSING, "this request needs an Idempotency-Key header")
    try:
        return parse_idempotency_key(raw)
    except InvalidIdempotencyKey as exc:
        raise ProblemError(IDEMPOTENCY_KEY_INVALID, str(exc)) from None


ClientId = Annotated[int, Depends(authenticated_client)]
PaymentCallerDep = Annotated[PaymentCaller, Depends(payment_caller)]
