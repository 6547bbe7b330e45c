"""One delivery of one batch row: paid through the payment's machine, and what the broker should be told.

Called by the consumer (app/workers/batch_consumer.py) for every message it
receives, knowing nothing of the broker: it returns a `Verdict`, and the
consumer acknowledges, asks for redelivery later, or dead-letters. The rule
it keeps (docs/batches.md#acknowledge-after-commit): ACK only once the row's
fate is durable here, never before the claim commits.

    the payment finished, or was released or parked
    at a SENT point (the recovery worker has it)      -> link the row to it, ACK
    refused: the payment reference is taken (the key
    was reaped; the row was paid by an earlier upload) -> link the row to that payment, ACK
    another attempt holds the key's lease, or the
    database or key table cannot answer now            -> RETRY later (nothing counted against the row)
    refused the same way on every delivery (the key
    was used for a different payment), or a bug        -> RETRY with backoff; DEAD after the last delivery

A delivery that is a duplicate (a redelivery after a lost ack, a re-publish,
a second upload of the file) meets the key row the first one wrote: the
matrix answers it with the stored response and nothing is paid twice.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.db.errors import database_unavailable, describe
from app.db.transaction import one_statement, read
from app.idempotency import key_table
from app.machine.engine import backoff_seconds
from app.payments import submission
from app.payments.models import PaymentRequest
from app.problems import (
    DUPLICATE_PAYMENT, KEY_TABLE_UNAVAILABLE, REQUEST_IN_PROGRESS, SERVICE_UNAVAILABLE, ProblemError,
)
from app.services import Services

log = logging.getLogger(__name__)

TRANSIENT = (REQUEST_IN_PROGRESS, SERVICE_UNAVAILABLE, KEY_TABLE_UNAVAILABLE)


@dataclass(frozen=True)
class Verdict:
    action: str  # "ack", "retry" or "dead"
    delay: float = 0.0  # for "retry": seconds until the broker delivers it again
    reason: str = ""


ACK = Verdict("ack")

# The row and what its key already holds, in one read, as the API's lookup
# reads the caller and the key together (an optimisation:
# docs/reference/performance.md, "A batch row and its key in one read").
# The key's look skips the days after tomorrow, as key_table's looks do
# (migration 0015).
_ROW = text(
    f"""
    SELECT r.client_id AS row_client_id, r.row_key, r.request, r.dead_lettered_at IS NOT NULL AS dead_lettered,
           {key_table.KEY_COLUMNS}
      FROM payment_batch_row r
      LEFT JOIN idempotency_key k
        ON k.client_id = r.client_id AND k.key = CAST(r.row_key AS text)
       AND k.stored_on <= key_table_last_day()
     WHERE r.batch_id = :batch_id AND r.row_number = :row_number
    """
)

# The row's link to its payment, from the key row the machine wrote: its own
# row, never the batch's. Idempotent: a redelivery writes the same value.
# The key's look skips the days after tomorrow, as app/idempotency/key_table.py's
# looks do (an optimisation: migration 0015).
_LINK = text(
    """
    UPDATE payment_batch_row r SET payment_id = k.payment_id
      FROM idempotency_key k
     WHERE r.batch_id = :batch_id AND r.row_number = :row_number
       AND k.client_id = r.client_id AND k.key = CAST(r.row_key AS text)
       AND k.stored_on <= key_table_last_day()
    RETURNING r.payment_id
    """
)
_LINK_DUPLICATE = text(
    "UPDATE payment_batch_row SET payment_id = :payment_id, duplicate = true"
    " WHERE batch_id = :batch_id AND row_number = :row_number"
)
_DEAD = text(
    "UPDATE payment_batch_row SET dead_lettered_at = coalesce(dead_lettered_at, now()), dead_letter_reason = :reason"
    " WHERE batch_id = :batch_id AND row_number = :row_number AND payment_id IS NULL"
)


async def consume_row(
    services: Services, batch_id: uuid.UUID, row_number: int, *, delivery: int, max_deliveries: int
) -> Verdict:
    """Pay the row (or answer it from what its key already holds); what to tell the broker."""
    settings = services.settings
    row = await read(services.engine, _fetch, batch_id, row_number)
    if row is None or row.dead_lettered:
        return ACK  # nothing of ours to pay: never published by us, or a person's already
    client_id, key, stored = row.client_id, row.key, row.stored
    try:
        request = PaymentRequest.model_validate(row.request)
        await submission.submit_payment(services, client_id, key, request, row=stored)
        await one_statement(services.engine, _link, batch_id, row_number)
        return ACK
    except ProblemError as refused:
        if refused.problem is DUPLICATE_PAYMENT:
            await one_statement(services.engine, _link_duplicate, batch_id, row_number,
                                uuid.UUID(refused.extensions["payment_id"]))
            return ACK
        if refused.problem in TRANSIENT:
            delay = float(refused.headers.get("Retry-After", settings.retry_after_seconds))
            if refused.problem is REQUEST_IN_PROGRESS and stored is not None:
                # Another owner's lease (a consumer that died holding it, say):
                # nothing can be done before it runs out.
                delay = max(delay, min(stored.lease_seconds_left, settings.lease_seconds))
            return Verdict("retry", delay, refused.problem.slug)
        reason = f"{refused.problem.slug}: {refused.detail}"
    except Exception as exc:
        if database_unavailable(exc):
            # Not the row's fault: it is tried again however often it takes.
            return Verdict("retry", backoff_seconds(delivery, settings.backoff_base_seconds,
                                                    settings.backoff_cap_seconds), describe(exc))
        log.exception("batch row %s/%s failed", batch_id, row_number)
        reason = f"error: {describe(exc)}"
    if delivery < max_deliveries:
        return Verdict("retry", backoff_seconds(delivery, settings.backoff_base_seconds,
                                                settings.backoff_cap_seconds), reason)
    await one_statement(services.engine, _dead, batch_id, row_number, reason)
    log.warning("batch row %s/%s dead-lettered after %s deliveries: %s", batch_id, row_number, delivery, reason)
    return Verdict("dead", reason=reason)


class Row(NamedTuple):
    """What paying a batch row starts from: the row, and its key's row if it has one."""

    client_id: int
    key: str  # the row's idempotency key
    request: dict[str, Any]  # the payment, as a POST /v1/payments body
    dead_lettered: bool
    stored: key_table.KeyRow | None  # the key row: none before the row's first claim, or once its key is reaped


async def _fetch(conn: AsyncConnection, batch_id: uuid.UUID, row_number: int) -> Row | None:
    found = (await conn.execute(_ROW, dict(batch_id=batch_id, row_number=row_number))).mappings().one_or_none()
    if found is None:
        return None
    return Row(found["row_client_id"], str(found["row_key"]), found["request"], found["dead_lettered"],
               key_table.joined_key_row(found))


async def _link(conn: AsyncConnection, batch_id: uuid.UUID, row_number: int) -> None:
    await conn.execute(_LINK, dict(batch_id=batch_id, row_number=row_number))


async def _link_duplicate(conn: AsyncConnection, batch_id: uuid.UUID, row_number: int, payment_id: uuid.UUID) -> None:
    await conn.execute(_LINK_DUPLICATE, dict(batch_id=batch_id, row_number=row_number, payment_id=payment_id))


async def _dead(conn: AsyncConnection, batch_id: uuid.UUID, row_number: int, reason: str) -> None:
    await conn.execute(_DEAD, dict(batch_id=batch_id, row_number=row_number, reason=reason[:500]))
