"""What a refund is: the request a client sends, the row we keep, the view we return.

The request model is the fingerprint's input, with the payment it refunds:
two bodies that validate to the same `RefundRequest` for the same payment
are the same refund.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

from app.payments.models import MAX_AMOUNT_MINOR, Reference, plain_text

RefundStatus = Literal["pending", "succeeded", "failed"]
Reason = Annotated[str, StringConstraints(min_length=1, max_length=140), BeforeValidator(plain_text)]


class RefundRequest(BaseModel):
    """Refund `amount` of a payment's charge to the payer's card (absent: everything still refundable)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"amount": 500, "reference": "rma-2001", "reason": "one item returned"},
                {"reference": "cancel-1001", "reason": "order cancelled"},
            ]
        },
    )

    amount: int | None = Field(
        default=None, strict=True, gt=0, le=MAX_AMOUNT_MINOR,
        description="Minor units. Absent: everything still refundable, whatever that is when the refund "
        "is reserved.",
    )
    reference: Reference = Field(
        description="Your identifier for this refund (a return merchandise authorisation, a "
        "cancellation). Unique per payment: a second refund with the same reference, under any "
        "key, is refused with 409 duplicate-refund naming the first. A failed refund frees it."
    )
    reason: Reason | None = Field(default=None, description="Free text, kept with the refund.")


@dataclass(frozen=True)
class Refund:
    """A row of the `refund` table."""

    id: uuid.UUID
    payment_id: uuid.UUID
    client_id: int
    idempotency_key: str
    reference: str
    reason: str | None
    amount_minor: int
    currency: str
    status: str
    psp_charge_id: str
    psp_refund_key: str
    psp_refund_id: str | None
    failure_code: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


class RefundFailure(BaseModel):
    code: str
    message: str


class RefundView(BaseModel):
    """The refund as a client sees it, in a POST response, from GET and in its events."""

    id: uuid.UUID
    object: Literal["refund"] = "refund"
    payment_id: uuid.UUID
    status: RefundStatus = Field(
        description="`pending` while the PSP has not settled it (never a failure); then `succeeded` "
        "(the payer's card is credited) or `failed` (nothing was refunded, and the amount is "
        "refundable again)."
    )
    amount: int
    currency: str
    reference: str
    reason: str | None
    failure: RefundFailure | None
    created_at: datetime

    @classmethod
    def of(cls, refund: Refund) -> RefundView:
        failure = None
        if refund.status == "failed":
            failure = RefundFailure(
                code=refund.failure_code or "refund_failed",
                message="The PSP could not refund the card; nothing was refunded, and the amount may be "
                "refunded again under a new key.",
            )
        return cls(
            id=refund.id, payment_id=refund.payment_id, status=refund.status,  # type: ignore[arg-type]
            amount=refund.amount_minor, currency=refund.currency, reference=refund.reference,
            reason=refund.reason, failure=failure, created_at=refund.created_at,
        )

    def body(self) -> str:
        """The exact text we send and store; a replay sends these bytes again."""
        return self.model_dump_json()


class RefundList(BaseModel):
    """One page of a payment's refunds, oldest first, with what is still refundable."""

    object: Literal["list"] = "list"
    data: list[RefundView]
    has_more: bool
    next_after: uuid.UUID | None = Field(description="Pass as `after` for the next page.")
    amount_refundable: int = Field(description="What a new refund of this payment may still take, in minor units.")
