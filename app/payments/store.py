"""SQL on the `payment` table, called by the phases inside their transaction."""

from __future__ import annotations

import uuid
from datetime import date

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.payments.models import Payment, PaymentRequest

_INSERT = text(
    """
    INSERT INTO payment
        (id, client_id, reference, amount_minor, currency, fee_minor, net_minor,
         card_token, beneficiary_name, beneficiary_iban, status, psp_charge_key)
    VALUES (:id, :client_id, :reference, :amount, :currency, :fee, :net,
            :card_token, :beneficiary_name, :beneficiary_iban, 'processing', :psp_charge_key)
    ON CONFLICT (client_id, reference) WHERE status NOT IN ('declined', 'failed') DO NOTHING
    RETURNING *
    """
)

_BY_REFERENCE = text(
    "SELECT id FROM payment WHERE client_id = :client_id AND reference = :reference "
    "AND status NOT IN ('declined', 'failed')"
)
_BY_ID = text("SELECT * FROM payment WHERE id = :id AND client_id = :client_id")

_UPDATE = {
    "charged": text(
        """
        UPDATE payment SET psp_charge_id = :charge_id, end_to_end_reference = :e2e,
                           rail_transfer_key = :transfer_key, payout_instructed_at = now(),
                           updated_at = now()
         WHERE id = :id RETURNING *
        """
    ),
    "declined": text(
        """
        UPDATE payment SET status = 'declined', psp_charge_id = :charge_id,
                           decline_code = :decline_code, updated_at = now()
         WHERE id = :id RETURNING *
        """
    ),
    "paid_out": text(
        """
        UPDATE payment SET status = 'succeeded', rail_transfer_id = :transfer_id, updated_at = now()
         WHERE id = :id RETURNING *
        """
    ),
    "payout_rejected": text(
        """
        UPDATE payment SET rail_transfer_id = :transfer_id, reject_reason = :reject_reason,
                           psp_refund_key = :refund_key, updated_at = now()
         WHERE id = :id RETURNING *
        """
    ),
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
    "refunded": text(
        """
        UPDATE payment SET status = 'failed', psp_refund_id = :refund_id, updated_at = now()
         WHERE id = :id RETURNING *
        """
    ),
}


# Parked payouts whose instruction was built in [since, until] (UTC days):
# what a reconciliation window must settle.
_PARKED_PAYOUTS = text(
    """
    SELECT p.*, k.key
      FROM payment p
      JOIN idempotency_key k ON k.client_id = p.client_id AND k.payment_id = p.id
     WHERE p.status = 'indeterminate'
       AND k.parked_at IS NOT NULL AND k.recovery_point = 'EXT2_SENT'
       AND p.payout_instructed_at >= CAST(:since AS date)
       AND p.payout_instructed_at < CAST(:until AS date) + 1
     ORDER BY p.payout_instructed_at
    """
)

_BY_END_TO_END = text("SELECT * FROM payment WHERE end_to_end_reference = ANY(CAST(:refs AS text[]))")


async def insert(
    conn: AsyncConnection,
    *,
    payment_id: uuid.UUID,
    client_id: int,
    request: PaymentRequest,
    fee: int,
    psp_charge_key: str,
) -> Payment | None:
    """The new payment, or None if one of the client's payments holds this reference."""
    row = (
        await conn.execute(
            _INSERT,
            dict(
                id=payment_id,
                client_id=client_id,
                reference=request.reference,
                amount=request.amount,
                currency=request.currency,
                fee=fee,
                net=request.amount - fee,
                card_token=request.card_token,
                beneficiary_name=request.beneficiary.name,
                beneficiary_iban=request.beneficiary.iban,
                psp_charge_key=psp_charge_key,
            ),
        )
    ).mappings().one_or_none()
    return None if row is None else Payment(**row)


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
