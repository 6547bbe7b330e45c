"""SQL on the `payment` table outside the hot path (whose statements are in app/payments/phases.py).

Lookups for the API and reconciliation, and the status changes of the rarer
phases (parking, reopening for reconciliation).
"""

from __future__ import annotations

import uuid
from datetime import date

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.payments.models import Payment

_BY_REFERENCE = text(
    "SELECT id FROM payment WHERE client_id = :client_id AND reference = :reference AND holds_reference"
)
_BY_ID = text("SELECT * FROM payment WHERE id = :id AND client_id = :client_id")

_UPDATE = {
    "indeterminate": text(
        """
        UPDATE payment SET status = 'indeterminate', updated_at = now()
         WHERE id = :id RETURNING *
        """
    ),
    "reopened": text(
        """
        UPDATE payment SET status = 'processing', updated_at = now()
         WHERE id = :id RETURNING *
        """
    ),
}


# Parked payouts whose instruction was built in [since, until] (UTC days):
# what a reconciliation window must settle. Found from the key table's side,
# through its index of parked operations (`idempotency_key_parked`: a
# handful of rows), then each payment by its primary key: `payment` has no
# index on its status, so that its updates can be HOT (migration 0014).
_PARKED_PAYOUTS = text(
    """
    SELECT p.*, k.key
      FROM idempotency_key k
      JOIN payment p ON p.id = k.payment_id AND p.client_id = k.client_id
     WHERE k.state = 'started' AND k.parked_at IS NOT NULL AND k.recovery_point = 'EXT2_SENT'
       AND p.status = 'indeterminate'
       AND p.payout_instructed_at >= CAST(:since AS date)
       AND p.payout_instructed_at < CAST(:until AS date) + 1
     ORDER BY p.payout_instructed_at
    """
)

_BY_END_TO_END = text("SELECT * FROM payment WHERE end_to_end_reference = ANY(CAST(:refs AS text[]))")


async def id_by_reference(conn: AsyncConnection, client_id: int, reference: str) -> uuid.UUID | None:
    return (await conn.execute(_BY_REFERENCE, dict(client_id=client_id, reference=reference))).scalar_one_or_none()


async def get(conn: AsyncConnection, client_id: int, payment_id: uuid.UUID) -> Payment | None:
    """A payment, only if it belongs to `client_id`."""
    row = (await conn.execute(_BY_ID, dict(id=payment_id, client_id=client_id))).mappings().one_or_none()
    return None if row is None else Payment(**row)


async def parked_payouts(conn: AsyncConnection, since: date, until: date) -> list[tuple[Payment, str]]:
    """(payment, its idempotency key) for each parked payout instructed in the window."""
    rows = (await conn.execute(_PARKED_PAYOUTS, dict(since=since, until=until))).mappings().all()
    return [(Payment(**{k: v for k, v in row.items() if k != "key"}), row["key"]) for row in rows]


async def by_end_to_end(conn: AsyncConnection, references: list[str]) -> dict[str, Payment]:
    rows = (await conn.execute(_BY_END_TO_END, dict(refs=references))).mappings().all()
    return {row["end_to_end_reference"]: Payment(**row) for row in rows}


async def update(conn: AsyncConnection, change: str, payment_id: uuid.UUID, **values) -> Payment:
    row = (await conn.execute(_UPDATE[change], dict(id=payment_id, **values))).mappings().one()
    return Payment(**row)
