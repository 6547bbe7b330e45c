"""Response models that exist only for the HTTP surface."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from app.idempotency.key_table import KeyRow
from app.outbox.events import Event
from app.payments.models import PaymentView


class TimelineEntry(BaseModel):
    at: datetime
    event: str
    recovery_point: str
    attempt: int


class KeyView(BaseModel):
    """An operation's state machine row, for learners and operators."""

    key: str
    endpoint: str
    state: Literal["started", "finished"]
    recovery_point: str = Field(description="The last fact made durable; see docs/request-path.md.")
    payment_id: uuid.UUID | None
    attempts: int
    lease_held: bool = Field(description="Whether an attempt owns the operation right now.")
    next_attempt_at: datetime | None = Field(
        description="When the recovery worker may next try it (a parked operation: its next re-probe); "
        "null once it is finished, since nothing is left to try."
    )
    parked: bool = Field(
        description="Given up after unknown outcomes (at once for a legacy rail): a person or "
        "reconciliation settles it; nobody resumes it blindly."
    )
    last_error: str | None
    response_code: int | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    timeline: list[TimelineEntry]

    @classmethod
    def of(cls, row: KeyRow) -> KeyView:
        return cls(
            key=row.key,
            endpoint=row.endpoint,
            state=row.state,  # type: ignore[arg-type]
            recovery_point=row.recovery_point,
            payment_id=row.payment_id,
            attempts=row.attempts,
            lease_held=row.lease_live,
            next_attempt_at=None if row.state == "finished" else row.next_attempt_at,
            parked=row.parked,
            last_error=row.last_error,
            response_code=row.response_code,
            created_at=row.created_at,
            updated_at=row.updated_at,
            finished_at=row.finished_at,
            timeline=[TimelineEntry(**entry) for entry in row.timeline],
        )


class ProblemDoc(BaseModel):
    type: str
    title: str
    status: int
    description: str


class EventView(BaseModel):
    """A decision about one of your payments, as `GET /v1/events` lists it and a webhook carries it."""

    id: uuid.UUID = Field(description="UUIDv7, time-ordered; the webhook's `webhook-id` (your idempotency key).")
    object: Literal["event"] = "event"
    type: str = Field(
        description="`payment.succeeded`, `payment.declined`, `payment.failed`, `payment.indeterminate`, "
        "or, for a payout the beneficiary's bank sent back later, `payment.returned` then `payment.refunded`."
    )
    created_at: datetime
    data: PaymentView = Field(description="The payment as it stood when the event was written.")

    @classmethod
    def of(cls, event: Event) -> EventView:
        return cls(id=event.id, type=event.type, created_at=event.created_at, data=event.data)


class EventList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EventView]
    has_more: bool = Field(description="More events follow: ask again with `after` = `next_after`.")
    next_after: uuid.UUID | None = Field(description="The last event's id here: the cursor for the next page.")
