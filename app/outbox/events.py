"""Events: the decisions a client must hear about, as rows written with the decision.

Where it sits: inside the phase that decides. Every statement that finishes
an operation ends with EMIT_SQL (appended by app/machine/statements.py),
which reads from the fence, so the event commits with its decision or not
at all, and a stale owner writes none; the decisions made by a transaction
rather than one statement (parking, recording a return) call `emit` inside
it. The webhook dispatcher (app/workers/webhooks.py) and
`GET /v1/events` (`feed`) read what is written here.
docs/outbox-inbox.md#1-events-written-with-the-decision says which phase
writes which type, and what an event holds.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

SUCCEEDED = "payment.succeeded"
DECLINED = "payment.declined"
FAILED = "payment.failed"
INDETERMINATE = "payment.indeterminate"
RETURNED = "payment.returned"
REFUNDED = "payment.refunded"
# A client's refund of a payment (app/payments/refunds/).
REFUND_SUCCEEDED = "refund.succeeded"
REFUND_FAILED = "refund.failed"
REFUND_PENDING = "refund.pending"  # still pending at the PSP after the last poll: reconciliation settles it
# Every row of a payment batch is final (app/payments/batches/progress.py); it names no payment.
BATCH_COMPLETED = "batch.completed"
# Stable names: a client's code switches on them. (The schema checks only
# their shape, so a new type needs no migration.)
TYPES = (SUCCEEDED, DECLINED, FAILED, INDETERMINATE, RETURNED, REFUNDED, REFUND_SUCCEEDED, REFUND_FAILED,
         REFUND_PENDING, BATCH_COMPLETED)
_OF_STATUS = {
    "succeeded": SUCCEEDED, "declined": DECLINED, "failed": FAILED, "indeterminate": INDETERMINATE,
    "returned": RETURNED, "refunded": REFUNDED,
}


def type_for(status: str) -> str:
    """The event a payment reaching `status` emits (KeyError for a status that emits none)."""
    return _OF_STATUS[status]


# The canonical text of the CTE a phase's statement ends with: the event.
# `fence` is the phase's first CTE: no fence row (a stale owner), no event.
# The payload is the stored response the same statement writes
# (:response_body). The event's `written_by` (its transaction, by the
# column's default) is what the webhook dispatcher's cursor reads it by:
# nothing more is written for a webhook until its first attempt
# (app/outbox/delivery.py).
EMIT_SQL = """
    emitted AS (
        INSERT INTO event (client_id, payment_id, type, data)
        SELECT :client_id, fence.payment_id, CAST(:event_type AS text), CAST(:response_body AS json)
          FROM fence
        RETURNING id
    )
"""

# An event `e` still after the webhook dispatcher's cursor: its webhook has
# had no first attempt yet (app/outbox/delivery.py reads and moves the
# cursor), so it has no delivery row unless a person asked for one. Events
# written before migration 0016 have no `written_by`, and never are.
AFTER_THE_CURSOR = ("e.written_by IS NOT NULL "
                    "AND (e.written_by, e.id) > (SELECT written_by, event_id FROM webhook_cursor)")

_EMIT = text(
    """
    INSERT INTO event (client_id, payment_id, type, data)
    VALUES (:client_id, :payment_id, :event_type, CAST(:data AS json))
    RETURNING id
    """
)

# How far behind the present the feed stays. An event's id is taken from
# the clock when its row is inserted, and the row becomes visible when its
# transaction commits a moment later. Without a margin, a reader could see a
# later event first, move its cursor past it, and never see the earlier one
# once that commits. One second is far longer than the gap between the
# insert and the commit of one statement.
FEED_HORIZON_SECONDS = 1.0
MAX_PAGE = 100

# The horizon as the smallest UUIDv7 of its millisecond: every id below it
# was made more than FEED_HORIZON_SECONDS ago, by the database's clock.
_FEED = text(
    """
    SELECT id, type, payment_id, data, created_at
      FROM event
     WHERE client_id = :client_id
       AND id > :after
       AND id < encode(substring(int8send(floor(extract(epoch FROM clock_timestamp()
                                                         - make_interval(secs => :horizon)) * 1000)::bigint)
                                 FROM 3) || decode(repeat('00', 10), 'hex'), 'hex')::uuid
     ORDER BY id
     LIMIT :limit
    """
)

NO_CURSOR = uuid.UUID(int=0)


@dataclass(frozen=True)
class Event:
    id: uuid.UUID
    type: str
    payment_id: uuid.UUID | None  # None for a batch's event
    data: dict[str, Any]
    created_at: datetime


async def emit(
    conn: AsyncConnection, *, client_id: int, payment_id: uuid.UUID | None, event_type: str, data: str
) -> uuid.UUID:
    """Write one event in the caller's transaction; its id."""
    assert event_type in TYPES, event_type
    return (
        await conn.execute(
            _EMIT, dict(client_id=client_id, payment_id=payment_id, event_type=event_type, data=data)
        )
    ).scalar_one()


async def feed(conn: AsyncConnection, client_id: int, after: uuid.UUID | None, limit: int) -> list[Event]:
    """The client's events after `after`, oldest first, at most `limit`, none younger than the horizon."""
    rows = await conn.execute(
        _FEED,
        dict(client_id=client_id, after=after or NO_CURSOR, limit=limit, horizon=FEED_HORIZON_SECONDS),
    )
    return [Event(**row) for row in rows.mappings()]
