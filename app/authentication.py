"""Who is asking: the client behind an API key and, for a payment, what it stored under its key.

Where it sits on a request's path: the API's dependencies (app/api/deps.py)
call it before any route runs, and the route hands what it returns to the
service. Each answer is one SELECT through `app.db.transaction.read`: nothing
is written, and the refusal (401) is the API's to give.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from app import client_accounts
from app.db.transaction import read
from app.idempotency.key_table import CALLER_SQL, KeyRow, joined_key_row
from app.services import Services


@dataclass(frozen=True)
class PaymentCaller:
    """Who sent a POST /v1/payments, under which key, and what that key already holds (None: nothing yet)."""

    client_id: int
    key: str
    row: KeyRow | None


@dataclass(frozen=True)
class CallerLookup:
    """One caller lookup made ahead of the route (app/fastpath/), for the API key and key it was made for."""

    api_key: str
    key: str
    caller: PaymentCaller | None  # None: no client has this API key


async def client_id(services: Services, api_key: str) -> int | None:
    """The id of the client holding `api_key`, or None."""
    return await read(services.engine, client_accounts.authenticate, api_key)


async def payment_caller(services: Services, api_key: str, key: str) -> PaymentCaller | None:
    """The client holding `api_key` and its row for `key`, in one read; None if no client holds it.

    A retry of a finished payment needs nothing else: the service answers it
    from this row alone.
    """
    return await read(services.engine, _caller, client_accounts.hash_api_key(api_key), key)


async def _caller(conn: AsyncConnection, api_key_hash: bytes, key: str) -> PaymentCaller | None:
    # CALLER_SQL is written for the driver ($1, $2), so it goes to it as is.
    row = (await conn.exec_driver_sql(CALLER_SQL, (api_key_hash, key))).mappings().one_or_none()
    return caller_of(row, key)


def caller_of(row: Mapping[str, Any] | None, key: str) -> PaymentCaller | None:
    """The caller a row of CALLER_SQL names, however it was read; None for no row (an unknown API key)."""
    if row is None:
        return None
    return PaymentCaller(row["caller_id"], key, joined_key_row(row))
