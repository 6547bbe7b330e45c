"""A small client for the payments API that behaves the way a client must (docs/reference/client.md).

    from payments_client import PaymentsClient

    with PaymentsClient("http://127.0.0.1:8000", api_key, store=Path("payments-client.json")) as client:
        payment = client.pay("order-1001", {"amount": 1250, "currency": "EUR", ...})
        refund = client.create_refund(payment["id"], 500, reference="rma-1001")

The server makes a retried request safe only if the retry carries the same
Idempotency-Key as the attempt it repeats. Getting that right is the client's
job, and it is where clients usually fail: `client.py` explains each rule and
the failure it prevents, `store.py` why the key is written to disk before the
first attempt, and `buggy.py` is the counter-example (a fresh key per retry).
docs/reference/client.md has the whole story and the demos that exercise it.
"""

from payments_client.buggy import buggy_pay
from payments_client.client import (
    RETRY_WINDOW_HOURS, DuplicateRefund, Event, PaymentNotRefundable, PaymentsClient, PaymentsError, ProblemError,
    Refund, RefundExceedsPayment, RefundFailure, RefundPage, RetriesExhausted, StillProcessing,
)
from payments_client.store import OperationStore

__all__ = [
    "RETRY_WINDOW_HOURS", "DuplicateRefund", "Event", "OperationStore", "PaymentNotRefundable", "PaymentsClient",
    "PaymentsError", "ProblemError", "Refund", "RefundExceedsPayment", "RefundFailure", "RefundPage",
    "RetriesExhausted", "StillProcessing", "buggy_pay",
]
