"""The payment service the routes call (app/api/routes.py): submit a payment, and read one back.

Submitting is the payment's fingerprint, then the engine's response matrix
on the payment's machine. The matrix
(app/machine/matrix.py, docs/response-matrix.md) is the same for
every operation:

    new key                            -> Handler1, then drive    -> 201 (or 202)
    key exists, different fingerprint
    or another endpoint's key          -> 422 idempotency-key-reused
    key exists, finished               -> the stored response, byte for byte
    key exists, started, lease live    -> 409 request-in-progress + Retry-After
    key exists, started, lease expired -> take over, then drive   -> 201 (or 202)
    key exists, parked (indeterminate) -> 202, status indeterminate, nothing driven
    new key, reference already in use  -> 409 duplicate-payment (nothing stored)
"""

from __future__ import annotations

import uuid

from app.db.transaction import read
from app.idempotency import store as keys
from app.idempotency.keys import request_fingerprint
from app.idempotency.store import KeyRow
from app.machine import matrix
from app.machine.engine import Finished
from app.machine.matrix import Reply
from app.outbox import events
from app.payments import store as payments
from app.payments.models import Payment, PaymentRequest
from app.payments.payment import PAYMENT
from app.services import Services


def fingerprint(request: PaymentRequest) -> bytes:
    """What makes two POSTs "the same payment": the validated request, canonically encoded."""
    return request_fingerprint("POST", "/v1/payments", request.model_dump(mode="json"))


def stored_response(row: KeyRow, request_hash: bytes) -> Finished | None:
    """The payment's response to replay for a retry of the same request, once finished; else None."""
    return matrix.stored_response(PAYMENT, row, request_hash)


async def submit_payment(
    services: Services, client_id: int, key: str, request: PaymentRequest, *, row: KeyRow | None
) -> Reply:
    """`row` is what the client stored under `key`, read (with its authentication) just before."""
    return await matrix.submit(services, PAYMENT, client_id, key, fingerprint(request), row=row, request=request)


async def find_payment(services: Services, client_id: int, payment_id: uuid.UUID) -> Payment | None:
    """The payment, only if it is `client_id`'s (another client's is not found, never forbidden)."""
    return await read(services.engine, payments.get, client_id, payment_id)


async def find_key(services: Services, client_id: int, key: str) -> KeyRow | None:
    """What `client_id` stored under `key`: the operation's state machine row and its timeline."""
    return await read(services.engine, keys.load, client_id, key)


async def events_after(
    services: Services, client_id: int, after: uuid.UUID | None, limit: int
) -> list[events.Event]:
    """The client's events after `after`, oldest first, at most `limit` (app/outbox/events.py::feed)."""
    return await read(services.engine, events.feed, client_id, after, limit)
