"""Submitting a payment, as POST /v1/payments does (app/api/routes.py): its fingerprint, then the matrix.

The response matrix runs on the payment's machine. The matrix
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

from app.idempotency.keys import request_fingerprint
from app.idempotency.key_table import KeyRow
from app.machine import matrix
from app.machine.engine import Finished
from app.machine.matrix import Reply
from app.payments.models import PaymentRequest
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

