"""SQL on the `refund` table outside its phases: what the GET routes, the console and the settlement read."""

from __future__ import annotations

import uuid

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.payments.refunds.models import Refund

_BY_ID = text("SELECT * FROM refund WHERE id = :id AND client_id = :client_id")
_OF_PAYMENT = text(
    """
    SELECT * FROM refund
     WHERE payment_id = :payment_id AND client_id = :client_id
       AND (CAST(:after AS uuid) IS NULL OR id > CAST(:after AS uuid))
     ORDER BY id
     LIMIT :limit
    """
)
# Parked refunds, with their key: what the PSP's settlement report settles.
_PARKED = text(
    """
    SELECT r.*, k.key
      FROM idempotency_key k
      JOIN refund r ON r.client_id = k.client_id AND r.idempotency_key = k.key AND r.payment_id = k.payment_id
     WHERE k.state = 'started' AND k.parked_at IS NOT NULL AND k.recovery_point = 'EXT5_SENT'
       AND r.status = 'pending'
     ORDER BY r.id
    """
)


async def get(conn: AsyncConnection, client_id: int, refund_id: uuid.UUID) -> Refund | None:
    """A refund, only if it belongs to `client_id`."""
    row = (await conn.execute(_BY_ID, dict(id=refund_id, client_id=client_id))).mappings().one_or_none()
    return None if row is None else Refund(**row)


async def of_payment(
    conn: AsyncConnection, client_id: int, payment_id: uuid.UUID, after: uuid.UUID | None, limit: int
) -> list[Refund]:
    """A payment's refunds after `after`, oldest first (their ids are time-ordered)."""
    rows = (
        await conn.execute(_OF_PAYMENT, dict(payment_id=payment_id, client_id=client_id, after=after, limit=limit))
    ).mappings().all()
    return [Refund(**row) for row in rows]


async def parked(conn: AsyncConnection) -> list[tuple[Refund, str]]:
    """(refund, its idempotency key) for each refund parked while the PSP still had it pending."""
    rows = (await conn.execute(_PARKED)).mappings().all()
    return [(Refund(**{k: v for k, v in row.items() if k != "key"}), row["key"]) for row in rows]
