"""The payment batch, as an operation: one phase that stores the whole file and its outbox, under the batch's key.

A batch is declared on the same engine as a payment (app/machine/engine.py),
under its own Idempotency-Key, scoped by its endpoint: the response matrix
(app/machine/matrix.py) answers a retry of the upload from the key row, and
the same key sent with another file (or to another endpoint) with 422.

    start   claim the batch's key; store the batch, every row with its natural
            key, and one outbox row per row; store the 202 as the key's
            response                                                -> finished

There is no external call in it: the rows reach the broker from the outbox
(app/workers/batch_publisher.py), which is what keeps the upload free of a
dual write (docs/batches.md#from-upload-to-broker-without-a-dual-write). Each row is then a
payment of its own, driven by a consumer (app/workers/batch_consumer.py)
through the payment's machine under the row's natural key.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection
from uuid6 import uuid7

from app.idempotency.key_table import CLAIM_SQL, KeyRow, Lease
from app.machine import engine
from app.machine.declare import FINISHED, Machine, Operation, Start
from app.machine.statements import Statement
from app.observability import metrics
from app.payments.batches.rows import BatchRow

ENDPOINT = "POST /v1/payment-batches"
# Accepted, not done: the rows are paid one by one afterwards. 202 is what
# the upload is, and what its replay says again.
ACCEPTED_STATUS_CODE = 202



@dataclass(frozen=True)
class Batch:
    """A row of `payment_batch`."""

    id: uuid.UUID
    client_id: int
    reference: str
    idempotency_key: str
    row_count: int
    created_at: datetime
    completed_at: datetime | None
    status: str = "accepted"  # the machine's subject reports itself as its final status


def accepted_body(batch: Batch) -> str:
    """The upload's response, stored under the batch's key and replayed byte for byte: small, whatever the file."""
    return json.dumps({
        "id": str(batch.id), "object": "payment_batch", "reference": batch.reference, "rows": batch.row_count,
        "status": "accepted", "created_at": batch.created_at.isoformat(),
    }, separators=(",", ":"))


_CLAIM = text(CLAIM_SQL)

_INSERT_BATCH = text(
    """
    INSERT INTO payment_batch (id, client_id, reference, idempotency_key, row_count)
    VALUES (:id, :client_id, :reference, :key, :row_count)
    RETURNING *
    """
)

# One statement for all the rows and one for their outbox, whatever the
# file's size: arrays, unnested by the database.
_INSERT_ROWS = text(
    """
    INSERT INTO payment_batch_row (batch_id, row_number, client_id, row_key, reference, value_date, request)
    SELECT :batch_id, r.n, :client_id, r.k, r.ref, r.d, r.req
      FROM unnest(CAST(:numbers AS int[]), CAST(:keys AS uuid[]), CAST(:references AS text[]),
                  CAST(:dates AS date[]), CAST(:requests AS jsonb[])) AS r(n, k, ref, d, req)
    """
)
_INSERT_OUTBOX = text(
    "INSERT INTO batch_outbox (batch_id, row_number) SELECT batch_id, row_number FROM payment_batch_row"
    " WHERE batch_id = :batch_id"
)

# The upload's finish: the key row's response, nothing else (the rows'
# payments emit their own events; the batch's completion emits its own).
ACCEPTED = Statement("finish", (), "SELECT * FROM fence", emits=False)


async def claim_batch(
    conn: AsyncConnection, machine: Machine[Batch], *, client_id: int, key: str, request_hash: bytes,
    reference: str, rows: list[BatchRow], lease_seconds: float,
) -> Operation[Batch] | None:
    """Claim the batch's key and store the batch, its rows and their outbox; None if the key already exists.

    Durable after commit, together: the key row (finished, its 202 stored),
    the batch, every row with its natural key and validated request, and one
    outbox row per row, which the publisher takes to the broker.
    Crash before commit: nothing of this upload exists; a retry (same key)
    starts afresh. Crash after commit: the client may not have heard the
    202; its retry replays it, and the publisher publishes the rows anyway.
    Running it again is safe: the claim finds the key and returns no row.
    """
    claimed = (
        await conn.execute(_CLAIM, dict(client_id=client_id, key=key, endpoint=machine.endpoint,
                                        request_hash=request_hash, recovery_point=FINISHED, payment_id=None,
                                        lease_seconds=lease_seconds))
    ).one_or_none()
    if claimed is None:
        return None
    lease = Lease(client_id, key, claimed.lease_token, claimed.stored_on)
    batch = Batch(**(await conn.execute(_INSERT_BATCH, dict(
        id=uuid7(), client_id=client_id, reference=reference, key=key, row_count=len(rows),
    ))).mappings().one())
    await conn.execute(_INSERT_ROWS, dict(
        batch_id=batch.id, client_id=client_id, numbers=[r.number for r in rows], keys=[r.key for r in rows],
        references=[r.reference for r in rows], dates=[r.value_date for r in rows],
        requests=[r.request.model_dump_json() for r in rows],
    ))
    await conn.execute(_INSERT_OUTBOX, dict(batch_id=batch.id))
    body = accepted_body(batch)
    await engine.fenced(conn, ACCEPTED, lease, recovery_point=FINISHED,
                        response_code=ACCEPTED_STATUS_CODE, response_body=engine.storable(body),
                        event=f"batch accepted: {len(rows)} rows")
    return Operation(machine, lease, FINISHED, batch, resumed=False, response=(ACCEPTED_STATUS_CODE, body))


_BY_KEY = text("SELECT * FROM payment_batch WHERE client_id = :client_id AND idempotency_key = :key"
               " ORDER BY created_at DESC LIMIT 1")


async def load(conn: AsyncConnection, row: KeyRow) -> Batch:
    return Batch(**(await conn.execute(_BY_KEY, dict(client_id=row.client_id, key=row.key))).mappings().one())


BATCH: Machine[Batch] = Machine(
    name="payment batch",
    endpoint=ENDPOINT,
    start=Start(claim_batch, "claim the batch's key; store the batch, its rows and their outbox; store the 202",
                leads_to=FINISHED, transaction=True),
    calls={},
    load=load,
    log_fields=lambda batch: {"batch_id": str(batch.id)},
    # `finished` is left as it is: no phase follows the start, so the engine
    # never reports a batch upload finished (its start counts it, accepted).
    started=metrics.BATCHES_ACCEPTED,
)
