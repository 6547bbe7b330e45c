"""Submitting and reading refunds, as the refund routes do (app/api/routes.py): the payment checked, then the matrix.

The response matrix (app/machine/matrix.py, docs/response-matrix.md) is the
payment's, run on the refund's machine; a refund adds the payment's own
checks before it and its business identity inside the claim:

    no such payment (or another client's)   -> 404, nothing stored
    payment not succeeded                   -> 409 payment-not-refundable, nothing stored
    new key                                 -> claim and reserve, then drive -> 201 (or 202 pending)
    new key, nothing left to cover it       -> 409 refund-exceeds-payment, stored under the key
    new key, reference already in use       -> 409 duplicate-refund (nothing stored)
    a payment's key, or another refund's    -> 422 idempotency-key-reused
"""

from __future__ import annotations

import uuid

from app.db.transaction import read
from app.idempotency.key_table import KeyRow
from app.idempotency.keys import request_fingerprint
from app.machine import matrix
from app.machine.matrix import Reply
from app.payments import payment_table
from app.payments.models import Payment
from app.payments.refunds import refund_table
from app.payments.refunds.models import Refund, RefundRequest
from app.payments.refunds.refund import REFUND
from app.problems import NOT_FOUND, PAYMENT_NOT_REFUNDABLE, ProblemError
from app.services import Services

MAX_PAGE = 100


def fingerprint(payment_id: uuid.UUID, request: RefundRequest) -> bytes:
    """What makes two POSTs "the same refund": the payment it refunds and the validated request."""
    return request_fingerprint("POST", f"/v1/payments/{payment_id}/refunds", request.model_dump(mode="json"))


async def submit_refund(
    services: Services, client_id: int, key: str, payment_id: uuid.UUID, request: RefundRequest,
    *, row: KeyRow | None,
) -> Reply:
    """`row` is what the client stored under `key`, read (with its authentication) just before."""
    request_hash = fingerprint(payment_id, request)
    if row is None:
        # A new key: the payment's checks come first, and store nothing. (The
        # claim checks the status again, under the payment's lock.) A retry
        # of a stored answer skips them: it is answered as it was first.
        payment = await payment_of(services, client_id, payment_id)
        if payment.status != "succeeded":
            raise ProblemError(PAYMENT_NOT_REFUNDABLE, f"payment {payment.id} is {payment.status}",
                               payment_status=payment.status)
    return await matrix.submit(
        services, REFUND, client_id, key, request_hash, row=row, payment_id=payment_id, request=request,
    )


async def payment_of(services: Services, client_id: int, payment_id: uuid.UUID) -> Payment:
    """The payment, only if it is `client_id`'s; 404 otherwise (another client's is not found, never forbidden)."""
    payment = await read(services.engine, payment_table.get, client_id, payment_id)
    if payment is None:
        raise ProblemError(NOT_FOUND, "no such payment")
    return payment


async def find_refund(services: Services, client_id: int, refund_id: uuid.UUID) -> Refund | None:
    return await read(services.engine, refund_table.get, client_id, refund_id)


async def refunds_of(
    services: Services, client_id: int, payment_id: uuid.UUID, after: uuid.UUID | None, limit: int
) -> tuple[Payment, list[Refund]]:
    """The payment (404 if not the client's) and its refunds after `after`, oldest first, at most `limit`."""
    payment = await payment_of(services, client_id, payment_id)
    return payment, await read(services.engine, refund_table.of_payment, client_id, payment_id, after, limit)
