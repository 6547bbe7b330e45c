"""The batch outbox's publisher, inside `payments consume`: claim rows, publish each, delete what the broker stored.

Where it sits: after the upload's commit. The upload wrote its rows and one
outbox row each in one transaction (app/payments/batches/batch.py); this
loop is the only thing that takes them to the broker, in three steps:

    claim    UPDATE ... SET claimed_until (a lease), FOR UPDATE SKIP LOCKED:
             committed, so several publishers never publish the same rows at once
    publish  each row with Nats-Msg-Id = its natural key, awaiting its PubAck
             (no transaction or pooled connection held meanwhile)
    delete   the outbox rows the broker acknowledged

A publisher that dies after publishing and before deleting leaves its
claim to run out; the rows are published again with the same message ids.
A publisher that lives but gets no PubAck (a broker node dying, a cluster
electing its stream's leader) shortens its claim on those rows to a
backoff that grows while the failures last, so a node's death delays them
by seconds, not by the whole claim.
Inside the duplicate window the broker drops the copy; after it, the copy is
delivered, and the consumer answers it from the row's key row (a replay):
harmless either way, which is why nothing here needs to be exactly once.
"""

from __future__ import annotations

import asyncio
import logging

from nats.js import JetStreamContext
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.broker import jetstream
from app.broker.jetstream import RowMessage
from app.db.errors import describe
from app.db.transaction import one_statement
from app.services import Services
from app.workers import outage_backoff, pause

log = logging.getLogger(__name__)

CLAIM_BATCH = 500
CLAIM_SECONDS = 30.0
RETRY_BASE_SECONDS = 0.5
IDLE_SECONDS = 0.2

_CLAIM = text(
    """
    WITH due AS (
        SELECT batch_id, row_number FROM batch_outbox
         WHERE claimed_until IS NULL OR claimed_until < now()
         ORDER BY batch_id, row_number
         LIMIT :limit
           FOR UPDATE SKIP LOCKED
    ), claimed AS (
        UPDATE batch_outbox o SET claimed_until = now() + make_interval(secs => :seconds)
          FROM due WHERE o.batch_id = due.batch_id AND o.row_number = due.row_number
        RETURNING o.batch_id, o.row_number
    )
    SELECT c.batch_id, c.row_number, r.row_key
      FROM claimed c JOIN payment_batch_row r ON r.batch_id = c.batch_id AND r.row_number = c.row_number
    """
)
_RETRY = text(
    "UPDATE batch_outbox o SET claimed_until = now() + make_interval(secs => :seconds)"
    " FROM unnest(CAST(:batches AS uuid[]), CAST(:numbers AS int[])) AS p(b, n)"
    " WHERE o.batch_id = p.b AND o.row_number = p.n"
)
_DELETE = text(
    "DELETE FROM batch_outbox o USING unnest(CAST(:batches AS uuid[]), CAST(:numbers AS int[])) AS p(b, n)"
    " WHERE o.batch_id = p.b AND o.row_number = p.n"
)


async def claim(conn: AsyncConnection, limit: int, seconds: float) -> list[RowMessage]:
    rows = await conn.execute(_CLAIM, dict(limit=limit, seconds=seconds))
    return [RowMessage(r.batch_id, r.row_number, str(r.row_key)) for r in rows]


async def retry_in(conn: AsyncConnection, failed: list[RowMessage], seconds: float) -> None:
    await conn.execute(_RETRY, dict(batches=[m.batch_id for m in failed], numbers=[m.row_number for m in failed],
                                    seconds=seconds))


async def delete(conn: AsyncConnection, published: list[RowMessage]) -> None:
    await conn.execute(_DELETE, dict(batches=[m.batch_id for m in published], numbers=[m.row_number for m in published]))


async def publish_once(services: Services, js: JetStreamContext, retry_seconds: float = CLAIM_SECONDS
                       ) -> tuple[int, int]:
    """One pass: claim, publish, delete; how many rows the broker stored, and how many it did not."""
    claimed = await one_statement(services.engine, claim, CLAIM_BATCH, CLAIM_SECONDS)
    if not claimed:
        return 0, 0
    results = await asyncio.gather(*(jetstream.publish(js, m) for m in claimed), return_exceptions=True)
    published = [m for m, result in zip(claimed, results) if not isinstance(result, BaseException)]
    failed = [m for m, result in zip(claimed, results) if isinstance(result, BaseException)]
    if failed:
        # No PubAck: nothing is known, so they are published again (the same
        # message ids: a copy the broker stored is dropped). Left claimed
        # for `retry_seconds` only: a dead node's stream has a new leader in
        # seconds, and the full claim would hold the rows back long after.
        first = next(r for r in results if isinstance(r, BaseException))
        log.warning("%s of %s rows not acknowledged by the broker (%s); published again in %.1f s",
                    len(failed), len(claimed), jetstream.describe(first), retry_seconds)
        await one_statement(services.engine, retry_in, failed, retry_seconds)
    if published:
        await one_statement(services.engine, delete, published)
    return len(published), len(failed)


async def publish_loop(services: Services, js: JetStreamContext, stop: asyncio.Event) -> None:
    failures = 0  # passes in a row that failed, wholly or for some rows
    while not stop.is_set():
        try:
            published, unacknowledged = await publish_once(
                services, js, outage_backoff(failures + 1, RETRY_BASE_SECONDS, CLAIM_SECONDS))
            failures = failures + 1 if unacknowledged else 0
        except Exception as exc:
            failures += 1
            log.warning("batch publisher pass failed: %s", describe(exc))
            await pause(stop, outage_backoff(failures, 0.5))
            continue
        if not published:
            await pause(stop, IDLE_SECONDS)
