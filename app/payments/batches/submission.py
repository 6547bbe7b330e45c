"""Submitting a batch, as POST /v1/payment-batches and `payments batches submit` do: validate, fingerprint, matrix.

    file with a bad row (any)          -> 400 invalid-batch, every bad row listed, nothing stored
    new key                            -> the batch, its rows and outbox stored -> 202
    key exists, same file              -> the stored 202, byte for byte (Idempotent-Replayed)
    key exists, another file, or
    another endpoint's key             -> 422 idempotency-key-reused

The batch's key only makes the upload safe to retry. What makes the same
file harmless under a new key, days later, is each row's natural key
(app/payments/batches/rows.py): the second batch's rows are paid by the
consumer as replays (or duplicate refusals) of the first's.
"""

from __future__ import annotations

import uuid

from app.db.transaction import read
from app.idempotency.key_table import KeyRow
from app.idempotency.keys import request_fingerprint
from app.machine import matrix
from app.machine.matrix import Reply
from app.payments.batches import progress
from app.payments.batches.batch import BATCH
from app.payments.batches.rows import BadBatch, BatchRow, parse
from app.problems import INVALID_BATCH, ProblemError
from app.services import Services

MEDIA_TYPES = ("text/csv", "application/x-ndjson", "application/jsonl")


def fingerprint(reference: str, rows: list[BatchRow]) -> bytes:
    """What makes two uploads "the same batch": its reference and every validated row, in order."""
    return request_fingerprint("POST", "/v1/payment-batches", {
        "reference": reference,
        "rows": [[r.number, str(r.key), r.request.model_dump(mode="json")] for r in rows],
    })


def validated(client_id: int, reference: str, body: bytes, media_type: str) -> list[BatchRow]:
    """The file's rows, or 400 invalid-batch listing every bad row (nothing stored)."""
    try:
        return parse(client_id, reference, body, media_type)
    except BadBatch as bad:
        raise ProblemError(
            INVALID_BATCH, f"{len(bad.problems)} problem(s); the whole file was refused and nothing was stored",
            errors=[p.as_dict() for p in bad.problems],
        ) from None


async def submit_batch(
    services: Services, client_id: int, key: str, reference: str, body: bytes, media_type: str,
    *, row: KeyRow | None,
) -> Reply:
    """`row` is what the client stored under `key`, read (with its authentication) just before."""
    rows = validated(client_id, reference, body, media_type)
    return await matrix.submit(services, BATCH, client_id, key, fingerprint(reference, rows), row=row,
                               reference=reference, rows=rows)


async def find_batch(services: Services, client_id: int, batch_id: uuid.UUID) -> progress.Progress | None:
    return await read(services.engine, progress.progress, client_id, batch_id)
