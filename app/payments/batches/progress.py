"""Where a batch stands, read from its rows' own payments; and its completion, decided once.

Read by `GET /v1/payment-batches/{id}` and by the completion sweep
(app/workers/batch_consumer.py). No row's consumer writes to the batch's
own row: a row's state is its payment's status (the consumer links the row
to its payment, on the row), so ten thousand consumers never queue on one
row lock. The batch is completed by whoever first sees every row final, in
one conditional UPDATE (`completed_at IS NULL`) that commits with the
`batch.completed` event: exactly one event, however many sweeps race.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.outbox import events
from app.payments.batches.rows import PAYMENT_REFERENCE_PREFIX

# A row is final once its payment is (or it was dead-lettered). `processing`
# and `indeterminate` payments are still moving; `queued` has no payment yet.
NOT_FINAL = ("queued", "processing", "indeterminate")
FAILED = ("declined", "failed", "returned", "refunded", "dead_lettered")
MAX_FAILED_LISTED = 500

# A row's payment: the one its consumer linked it to; else the one its
# natural key's key row names, if that payment is this row's (its reference
# is the row's, rows.py::payment_reference). A row of a second upload whose
# publish the broker dropped as a duplicate (its message id is the row's key,
# inside the duplicate window) is never consumed itself: its first upload's
# row was, under the same key. But a key the client had already used for
# another payment names that payment, not the row's: the row is refused on
# every delivery and dead-lettered, and until then it is not paid (counted
# as paid, it let a batch complete before its poison row's last delivery).
_PAYMENT_OF_ROW = f"""
      LEFT JOIN idempotency_key k ON r.payment_id IS NULL AND k.client_id = r.client_id
                                 AND k.key = CAST(r.row_key AS text)
      LEFT JOIN payment p ON p.id = coalesce(r.payment_id, k.payment_id)
                         AND (r.payment_id IS NOT NULL
                              OR p.reference = '{PAYMENT_REFERENCE_PREFIX}' || CAST(r.row_key AS text))
"""

_STATE = """
    CASE WHEN r.dead_lettered_at IS NOT NULL THEN 'dead_lettered'
         WHEN p.id IS NULL THEN 'queued'
         ELSE p.status END
"""

_COUNTS = text(
    f"""
    SELECT {_STATE} AS state, count(*) AS n
      FROM payment_batch_row r {_PAYMENT_OF_ROW}
     WHERE r.batch_id = :batch_id
     GROUP BY 1
    """
)

_FAILED_ROWS = text(
    f"""
    SELECT r.row_number, r.reference, r.value_date, r.row_key, p.id AS payment_id, {_STATE} AS state,
           coalesce(r.dead_letter_reason, p.decline_code, p.reject_reason, p.return_reason) AS reason
      FROM payment_batch_row r {_PAYMENT_OF_ROW}
     WHERE r.batch_id = :batch_id AND (r.dead_lettered_at IS NOT NULL OR p.status IN ('declined', 'failed', 'returned', 'refunded'))
     ORDER BY r.row_number
     LIMIT :limit
    """
)

_BATCH = text("SELECT * FROM payment_batch WHERE id = :batch_id AND client_id = :client_id")

# Only if no row is still moving, and only once.
_COMPLETE = text(
    f"""
    UPDATE payment_batch b SET completed_at = now()
     WHERE b.id = :batch_id AND b.completed_at IS NULL
       AND NOT EXISTS (SELECT 1 FROM payment_batch_row r {_PAYMENT_OF_ROW}
                        WHERE r.batch_id = b.id AND r.dead_lettered_at IS NULL
                          AND (p.id IS NULL OR p.status IN ('processing', 'indeterminate')))
    RETURNING *
    """
)

_OPEN = text("SELECT id FROM payment_batch WHERE completed_at IS NULL ORDER BY created_at LIMIT :limit")


@dataclass(frozen=True)
class Progress:
    batch: dict[str, Any]
    counts: dict[str, int]
    failed_rows: list[dict[str, Any]]
    failed_rows_omitted: int

    def view(self) -> dict[str, Any]:
        b = self.batch
        done = sum(n for state, n in self.counts.items() if state not in NOT_FINAL)
        return {
            "id": str(b["id"]), "object": "payment_batch", "reference": b["reference"], "rows": b["row_count"],
            "status": "completed" if b["completed_at"] else "in_progress", "final_rows": done,
            "counts": self.counts, "failed_rows": self.failed_rows, "failed_rows_omitted": self.failed_rows_omitted,
            "created_at": _iso(b["created_at"]), "completed_at": _iso(b["completed_at"]),
        }


def _iso(at: datetime | None) -> str | None:
    return at.isoformat() if at else None


async def progress(conn: AsyncConnection, client_id: int, batch_id: uuid.UUID) -> Progress | None:
    """The batch's counts by state and its failed rows; None if it is not this client's."""
    batch = (await conn.execute(_BATCH, dict(batch_id=batch_id, client_id=client_id))).mappings().one_or_none()
    if batch is None:
        return None
    return await _progress_of(conn, dict(batch))


async def _progress_of(conn: AsyncConnection, batch: dict[str, Any]) -> Progress:
    counts = {r["state"]: r["n"] for r in (await conn.execute(_COUNTS, dict(batch_id=batch["id"]))).mappings()}
    failed = [
        {"row": r["row_number"], "reference": r["reference"], "value_date": r["value_date"].isoformat(),
         "key": str(r["row_key"]), "payment_id": str(r["payment_id"]) if r["payment_id"] else None,
         "state": r["state"], "reason": r["reason"]}
        for r in (await conn.execute(_FAILED_ROWS, dict(batch_id=batch["id"], limit=MAX_FAILED_LISTED))).mappings()
    ]
    total_failed = sum(n for state, n in counts.items() if state in FAILED)
    return Progress(batch, counts, failed, max(0, total_failed - len(failed)))


async def open_batches(conn: AsyncConnection, limit: int) -> list[uuid.UUID]:
    return [r[0] for r in await conn.execute(_OPEN, dict(limit=limit))]


async def complete(conn: AsyncConnection, batch_id: uuid.UUID) -> Progress | None:
    """Mark the batch completed and emit `batch.completed`, if every row is final and nobody did yet.

    Durable after commit, together: `completed_at` and the event (with its
    webhook delivery). Crash before commit: neither; the next sweep does it.
    Two sweeps at once: the second waits for the first's row lock, finds
    `completed_at` set, and writes nothing. None: not (or no longer) to do.
    """
    batch = (await conn.execute(_COMPLETE, dict(batch_id=batch_id))).mappings().one_or_none()
    if batch is None:
        return None
    done = await _progress_of(conn, dict(batch))
    await events.emit(conn, client_id=batch["client_id"], payment_id=None, event_type=events.BATCH_COMPLETED,
                      data=json.dumps(done.view(), separators=(",", ":")))
    return done
