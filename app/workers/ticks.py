"""Durable scheduler ticks: a job runs once per intended UTC window, whoever tries.

A job name and its intended UTC window make a unique execution record. Every
worker replica may try to claim a window; the primary key (job, window_start)
lets exactly one insert win. A run holds a lease, like an operation does: if
it dies halfway, its row stays `started` until the lease expires and the next
claim takes it over; if it fails, the next claim retries the window. Every
write a run makes is fenced by its lease token (`renew`), so a stale run that
lost its window to another changes nothing.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import date
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.idempotency.key_table import LeaseLost


@dataclass(frozen=True)
class RunLease:
    job: str
    window_start: date
    token: uuid.UUID
    attempt: int


# One statement claims a new window, or takes over one whose run failed or
# died (lease expired). A finished window, or one with a live run, returns no
# row: somebody else has it.
_CLAIM = text(
    """
    INSERT INTO scheduled_run AS r (job, window_start, state, lease_token, lease_expires_at)
    VALUES (:job, :window_start, 'started', gen_random_uuid(), now() + make_interval(secs => :lease_seconds))
    ON CONFLICT (job, window_start) DO UPDATE
       SET state = 'started',
           lease_token = gen_random_uuid(),
           lease_expires_at = now() + make_interval(secs => :lease_seconds),
           attempts = r.attempts + 1,
           error = NULL,
           started_at = now()
     WHERE r.state = 'failed' OR (r.state = 'started' AND r.lease_expires_at < now())
    RETURNING lease_token, attempts
    """
)

_RENEW = text(
    """
    UPDATE scheduled_run SET lease_expires_at = now() + make_interval(secs => :lease_seconds)
     WHERE job = :job AND window_start = :window_start AND lease_token = :token AND state = 'started'
    """
)

_END = text(
    """
    UPDATE scheduled_run
       SET state = :state, counts = CAST(:counts AS jsonb), error = :error,
           lease_token = NULL, lease_expires_at = NULL, finished_at = now()
     WHERE job = :job AND window_start = :window_start AND lease_token = :token AND state = 'started'
    """
)

_GET = text("SELECT * FROM scheduled_run WHERE job = :job AND window_start = :window_start")


async def claim(conn: AsyncConnection, job: str, window_start: date, lease_seconds: float) -> RunLease | None:
    row = (
        await conn.execute(_CLAIM, dict(job=job, window_start=window_start, lease_seconds=lease_seconds))
    ).one_or_none()
    return None if row is None else RunLease(job, window_start, row.lease_token, row.attempts)


async def renew(conn: AsyncConnection, run: RunLease, lease_seconds: float) -> None:
    """Prove this run still owns its window (and extend it), or raise LeaseLost."""
    result = await conn.execute(
        _RENEW, dict(job=run.job, window_start=run.window_start, token=run.token, lease_seconds=lease_seconds)
    )
    if result.rowcount != 1:
        raise LeaseLost(f"run {run.job} {run.window_start} lost its window")


async def finish(conn: AsyncConnection, run: RunLease, counts: dict[str, Any]) -> None:
    await _end(conn, run, "finished", counts, None)


async def fail(conn: AsyncConnection, run: RunLease, error: str) -> None:
    await _end(conn, run, "failed", {}, error)


async def get(conn: AsyncConnection, job: str, window_start: date) -> dict[str, Any] | None:
    row = (await conn.execute(_GET, dict(job=job, window_start=window_start))).mappings().one_or_none()
    return None if row is None else dict(row)


async def _end(conn: AsyncConnection, run: RunLease, state: str, counts: dict[str, Any], error: str | None) -> None:
    result = await conn.execute(
        _END,
        dict(job=run.job, window_start=run.window_start, token=run.token, state=state,
             counts=json.dumps(counts), error=error),
    )
    if result.rowcount != 1:
        raise LeaseLost(f"run {run.job} {run.window_start} lost its window")
