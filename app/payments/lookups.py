"""Reading a payment back, as the GET routes do (app/api/routes.py): a payment, its key row, its events.

One SELECT each, outside any transaction (`app.db.transaction.read`); every
read is scoped to the asking client, so another client's payment or key is
simply not found.
"""

from __future__ import annotations

import uuid

from app.db.transaction import read
from app.idempotency import key_table
from app.idempotency.key_table import KeyRow
from app.outbox import events
from app.payments import payment_table
from app.payments.models import Payment
from app.services import Services


async def find_payment(services: Services, client_id: int, payment_id: uuid.UUID) -> Payment | None:
    """The payment, only if it is `client_id`'s (another client's is not found, never forbidden)."""
    return await read(services.engine, payment_table.get, client_id, payment_id)


async def find_key(services: Services, client_id: int, key: str) -> KeyRow | None:
    """What `client_id` stored under `key`: the operation's state machine row and its timeline."""
    return await read(services.engine, key_table.load, client_id, key)


async def events_after(
    services: Services, client_id: int, after: uuid.UUID | None, limit: int
) -> list[events.Event]:
    """The client's events after `after`, oldest first, at most `limit` (app/outbox/events.py::feed)."""
    return await read(services.engine, events.feed, client_id, after, limit)
