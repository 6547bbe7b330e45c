"""The key table: its SQL, and the operations on it outside the hot path.

Where it sits: below the engine (app/machine/engine.py). Ownership is decided
by the database alone: a claim (CLAIM_SQL) returns a new lease or nothing, a
takeover is a conditional UPDATE, and every later write names its lease
token, so a stalled owner updates zero rows (`LeaseLost`); leases use the
database's clock. CLAIM_SQL, ADVANCE_SQL and FINISH_SQL are the fence every
phase's statement starts with (app/machine/statements.py); CALLER_SQL is the
read that starts every POST (app/authentication.py). The functions here take
a connection from `app.db.transaction` and never commit.
docs/request-path.md#the-fencing-condition explains the fence.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import date, datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection


class LeaseLost(Exception):
    """This attempt no longer owns the operation: its phase wrote nothing, and it must stop."""


@dataclass(frozen=True)
class Lease:
    """Proof of ownership: the only thing a phase needs to write to the key row."""

    client_id: int
    key: str
    token: uuid.UUID
    # The day partition the key row is stored in (its `stored_on`), so that
    # every fenced write names the one partition to look in rather than
    # searching them all (an optimisation: docs/reference/performance.md,
    # "One new payment in the database, statement by statement").
    stored_on: date


@dataclass(frozen=True)
class KeyRow:
    client_id: int
    key: str
    endpoint: str
    request_hash: bytes
    state: str
    recovery_point: str
    payment_id: uuid.UUID | None
    lease_live: bool
    lease_seconds_left: float
    attempts: int
    next_attempt_at: datetime
    parked: bool
    last_error: str | None
    response_code: int | None
    response_body: str | None
    timeline: list[dict[str, Any]]
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


# The key row's columns as every read selects them (the key table as `k`),
# also for a read that joins the key row to something else: the caller's
# lookup below, a batch row's read (app/payments/batches/consumption.py).
KEY_COLUMNS = """
    k.client_id, k.key, k.endpoint, k.request_hash, k.state, k.recovery_point, k.payment_id,
    coalesce(k.lease_expires_at > now(), false) AS lease_live,
    greatest(extract(epoch FROM k.lease_expires_at - now()), 0)::float8 AS lease_seconds_left,
    k.attempts, k.next_attempt_at, k.parked_at IS NOT NULL AS parked,
    k.last_error, k.response_code, k.response_body, k.timeline,
    k.created_at, k.updated_at, k.finished_at
"""

# One timeline entry per state change, appended in the same UPDATE as the
# change itself, so the history can never disagree with the row.
def _event(recovery_point: str = "CAST(:recovery_point AS text)", attempt: str = "attempts") -> str:
    """The timeline entry appended by an UPDATE; SET expressions see the row before the update."""
    return (
        "timeline || jsonb_build_object('at', now(), 'event', CAST(:event AS text), "
        f"'recovery_point', {recovery_point}, 'attempt', {attempt})"
    )


_EVENT = _event()  # the recovery point the statement sets
_EVENT_IN_PLACE = _event(recovery_point="recovery_point")  # the recovery point stays as it is
_EVENT_NEW_ATTEMPT = _event(recovery_point="recovery_point", attempt="attempts + 1")  # a takeover

# The claim, the advance and the finish below are also the first step (the
# "fence") of the single-statement phases (app/machine/statements.py).
#
# The claim calls claim_idempotency_key (migration 0006; its look bounded by
# 0015): it takes an advisory lock on (client_id, key), looks for the key in
# every day's partition up to tomorrow's with a snapshot taken after the
# lock, and inserts the row into today's partition only if the key is
# nowhere. It returns the new lease token, or NULL (so no row here) when the
# key exists: the caller then reads the stored row. Its INSERT fails with "no
# partition ... found for row" if today's partition is missing
# (app/machine/matrix.py::_start answers that 503).
# `stored_on` is the day the function stored the row under: key_table_day()
# reads the transaction's clock, the same inside the function and out.
CLAIM_SQL = """
    SELECT claimed.lease_token, key_table_day() AS stored_on
      FROM claim_idempotency_key(:client_id, :key, :endpoint, :request_hash, :recovery_point,
                                 :payment_id, :lease_seconds) AS claimed(lease_token)
     WHERE claimed.lease_token IS NOT NULL
"""

# A key's row wherever it was stored. Bounded as the caller's lookup below
# is: no key row is stored on a day after tomorrow, so those days'
# partitions are pruned when the statement starts (an optimisation:
# migration 0015, and docs/reference/performance.md, "A new payment's looks
# skip the days ahead").
_LOAD = text(
    f"SELECT {KEY_COLUMNS} FROM idempotency_key k"
    " WHERE k.client_id = :client_id AND k.key = :key AND k.stored_on <= key_table_last_day()"
)

# Who is asking, and what (if anything) they stored under this key, in one
# read: the common retry, of a finished payment, is answered from it alone.
# Run by asyncpg itself (see app/db/engine.py), hence $1 and $2.
# No key row is stored on a day after tomorrow (`key_table_last_day()`), so
# the partitions of the days after it are pruned when the statement starts
# and never probed, as in the claim's own look (an optimisation: migration
# 0015, and docs/reference/performance.md, "A new payment's looks skip the
# days ahead").
CALLER_SQL = f"""
    SELECT c.id AS caller_id, {KEY_COLUMNS}
      FROM client c
      LEFT JOIN idempotency_key k ON k.client_id = c.id AND k.key = $2 AND k.stored_on <= key_table_last_day()
     WHERE c.api_key_hash = $1
"""

# Take over only from an owner that looks dead. Of two concurrent retries,
# the second waits for the first's row lock, re-checks the WHERE clause
# against the new lease, and gets no row. `not_sent` is read and reset in the
# same statement: the last owner said it certainly sent nothing (so the new
# owner need not probe), and from now on the new owner may send.
_TAKE_OVER = text(
    f"""
    UPDATE idempotency_key k
       SET lease_token = gen_random_uuid(),
           lease_expires_at = now() + make_interval(secs => :lease_seconds),
           attempts = attempts + 1,
           not_sent = false,
           updated_at = now(),
           timeline = {_EVENT_NEW_ATTEMPT}
      FROM (SELECT not_sent FROM idempotency_key
             WHERE client_id = :client_id AND key = :key FOR UPDATE) AS before
     WHERE k.client_id = :client_id AND k.key = :key
       AND k.state = 'started' AND k.parked_at IS NULL
       AND (k.lease_expires_at IS NULL OR k.lease_expires_at < now())
    RETURNING k.lease_token, k.stored_on, before.not_sent
    """
)

# The fencing check is the `lease_token = :token` in the WHERE clause: a stale
# owner's UPDATE matches no row, so nothing that joins it is written either
# (app/machine/statements.py), and the caller raises LeaseLost.
ADVANCE_SQL = f"""
    UPDATE idempotency_key
       SET recovery_point = :recovery_point,
           lease_expires_at = now() + make_interval(secs => :lease_seconds),
           last_error = NULL,
           updated_at = now(),
           timeline = {_EVENT}
     WHERE client_id = :client_id AND key = :key AND stored_on = :stored_on
       AND lease_token = :token AND state = 'started'
    RETURNING payment_id
"""

FINISH_SQL = f"""
    UPDATE idempotency_key
       SET state = 'finished',
           recovery_point = :recovery_point,
           response_code = :response_code,
           response_body = :response_body,
           lease_token = NULL,
           lease_expires_at = NULL,
           last_error = NULL,
           finished_at = now(),
           updated_at = now(),
           timeline = {_EVENT}
     WHERE client_id = :client_id AND key = :key AND stored_on = :stored_on
       AND lease_token = :token AND state = 'started'
    RETURNING payment_id
"""

# Releasing the lease invites the next actor (a retry, the recovery worker) to
# take over at once instead of waiting for the lease to run out.
_RELEASE = text(
    f"""
    UPDATE idempotency_key
       SET lease_token = NULL,
           lease_expires_at = NULL,
           last_error = :error,
           not_sent = :not_sent,
           next_attempt_at = now() + make_interval(secs => :retry_in),
           updated_at = now(),
           timeline = {_EVENT_IN_PLACE}
     WHERE client_id = :client_id AND key = :key AND stored_on = :stored_on
       AND lease_token = :token AND state = 'started'
    """
)


# Parking stops the retries: the takeover above skips parked rows, so no
# retry and no worker resumes it blindly any more. Where the external system
# answers probes, the worker asks it again at `next_attempt_at` (every
# PARKED_RECHECK_SECONDS, see _CLAIM_RECHECK); a parked payout to a rail that
# cannot be probed waits for reconciliation.
_PARK = text(
    f"""
    UPDATE idempotency_key
       SET lease_token = NULL,
           lease_expires_at = NULL,
           parked_at = now(),
           next_attempt_at = now() + make_interval(secs => :recheck_in),
           last_error = :error,
           not_sent = :not_sent,
           updated_at = now(),
           timeline = {_EVENT_IN_PLACE}
     WHERE client_id = :client_id AND key = :key AND stored_on = :stored_on
       AND lease_token = :token AND state = 'started'
    """
)

# A parked operation is taken back only by someone who has learned something
# about it: reconciliation, from the rail's statement, or the worker's
# re-probe, from the external system's answer. It is due for the recovery
# sweep at once, in case its new owner dies too.
_UNPARK = text(
    f"""
    UPDATE idempotency_key
       SET parked_at = NULL,
           lease_token = gen_random_uuid(),
           lease_expires_at = now() + make_interval(secs => :lease_seconds),
           next_attempt_at = now(),
           not_sent = false,
           attempts = attempts + 1,
           updated_at = now(),
           timeline = {_EVENT_NEW_ATTEMPT}
     WHERE client_id = :client_id AND key = :key
       AND state = 'started' AND parked_at IS NOT NULL
    RETURNING lease_token, stored_on, attempts
    """
)

# What the recovery worker sweeps: unfinished, unparked, due, with no live
# owner, and old enough that its first attempt is surely over. The partial
# index idempotency_key_unfinished holds only unfinished, unparked rows (a
# tiny fraction of the table), ordered by when they are due.
_STRANDED = text(
    """
    SELECT client_id, key
      FROM idempotency_key
     WHERE state = 'started' AND parked_at IS NULL
       AND next_attempt_at <= now()
       AND (lease_expires_at IS NULL OR lease_expires_at < now())
       AND created_at < now() - make_interval(secs => :min_age)
     ORDER BY next_attempt_at
     LIMIT :limit
    """
)


# What the worker reports as its backlog (app/workers/recovery.py): the
# operations its sweep would take now (the same conditions as _STRANDED), how
# long the oldest of them has been due, and how many are unfinished or parked
# in all. Each count reads one of the two partial indexes (their WHERE
# clauses are repeated exactly), which hold only unfinished rows: cheap
# however many finished keys the table holds.
_BACKLOG = text(
    """
    SELECT due.n AS due,
           coalesce(extract(epoch FROM now() - due.oldest), 0)::float8 AS oldest_due_seconds,
           (SELECT count(*) FROM idempotency_key
             WHERE state = 'started' AND parked_at IS NULL) AS unfinished,
           (SELECT count(*) FROM idempotency_key
             WHERE state = 'started' AND parked_at IS NOT NULL) AS parked
      FROM (SELECT count(*) AS n, min(next_attempt_at) AS oldest
              FROM idempotency_key
             WHERE state = 'started' AND parked_at IS NULL
               AND next_attempt_at <= now()
               AND (lease_expires_at IS NULL OR lease_expires_at < now())
               AND created_at < now() - make_interval(secs => :min_age)) AS due
    """
)


@dataclass(frozen=True)
class Backlog:
    due: int  # what a sweep would take now
    oldest_due_seconds: float  # how long the oldest of those has waited past its due time
    unfinished: int  # started, not parked: in flight or due
    parked: int


# The worker's re-probe of a parked operation: claim this round of it by
# moving `next_attempt_at` on, so that of several workers one asks, and asks
# again only after `recheck_in` seconds. It writes no timeline entry and no
# attempt: a re-probe that learns nothing leaves the row as it was.
_CLAIM_RECHECK = text(
    """
    UPDATE idempotency_key
       SET next_attempt_at = now() + make_interval(secs => :recheck_in)
     WHERE client_id = :client_id AND key = :key
       AND state = 'started' AND parked_at IS NOT NULL AND next_attempt_at <= now()
    RETURNING recovery_point, payment_id
    """
)

# Parked operations due for a re-probe (the partial index idempotency_key_parked).
_PARKED_DUE = text(
    """
    SELECT client_id, key
      FROM idempotency_key
     WHERE state = 'started' AND parked_at IS NOT NULL AND next_attempt_at <= now()
     ORDER BY next_attempt_at
     LIMIT :limit
    """
)


async def load(conn: AsyncConnection, client_id: int, key: str) -> KeyRow | None:
    row = (await conn.execute(_LOAD, dict(client_id=client_id, key=key))).mappings().one_or_none()
    return None if row is None else KeyRow(**row)


_KEY_FIELDS = tuple(f.name for f in fields(KeyRow))


def joined_key_row(columns: Mapping[str, Any]) -> KeyRow | None:
    """The key row among the columns of a read that LEFT JOINs it (KEY_COLUMNS); None where it joined none."""
    return None if columns["key"] is None else KeyRow(**{name: columns[name] for name in _KEY_FIELDS})


async def take_over(
    conn: AsyncConnection, client_id: int, key: str, lease_seconds: float, *, event: str
) -> tuple[Lease, bool] | None:
    """Become the owner of an unfinished operation whose lease has run out.

    Also returns whether the last owner said it certainly sent nothing
    (`not_sent`): then the call need not be probed before it is sent.
    """
    row = (
        await conn.execute(
            _TAKE_OVER,
            dict(client_id=client_id, key=key, lease_seconds=lease_seconds, event=event),
        )
    ).one_or_none()
    return None if row is None else (Lease(client_id, key, row.lease_token, row.stored_on), row.not_sent)


async def release(
    conn: AsyncConnection, lease: Lease, error: str, retry_in: float, *, event: str, not_sent: bool = False
) -> None:
    """Give up ownership without changing the recovery point, or raise LeaseLost.

    The worker will not try again for `retry_in` seconds (a client retry may).
    `not_sent`: this attempt certainly sent nothing at this recovery point.
    """
    await _fenced(conn, _RELEASE, lease, error=error, retry_in=retry_in, event=event, not_sent=not_sent)


async def park(
    conn: AsyncConnection, lease: Lease, error: str, recheck_in: float, *, event: str, not_sent: bool = False
) -> None:
    """Stop retrying: the outcome stays unknown until a re-probe or reconciliation learns it."""
    await _fenced(conn, _PARK, lease, error=error, recheck_in=recheck_in, event=event, not_sent=not_sent)


async def claim_recheck(
    conn: AsyncConnection, client_id: int, key: str, recheck_in: float
) -> tuple[str, uuid.UUID] | None:
    """(recovery point, payment id) of a parked operation whose re-probe is due, now ours to make; else None."""
    row = (
        await conn.execute(_CLAIM_RECHECK, dict(client_id=client_id, key=key, recheck_in=recheck_in))
    ).one_or_none()
    return None if row is None else (row.recovery_point, row.payment_id)


async def parked_due(conn: AsyncConnection, *, limit: int) -> list[tuple[int, str]]:
    rows = await conn.execute(_PARKED_DUE, dict(limit=limit))
    return [(r.client_id, r.key) for r in rows]


async def unpark(conn: AsyncConnection, client_id: int, key: str, lease_seconds: float, *, event: str) -> tuple[Lease, int] | None:
    """Own a parked operation again (for reconciliation); None if it is not parked."""
    row = (
        await conn.execute(_UNPARK, dict(client_id=client_id, key=key, lease_seconds=lease_seconds, event=event))
    ).one_or_none()
    return None if row is None else (Lease(client_id, key, row.lease_token, row.stored_on), row.attempts)


async def stranded(conn: AsyncConnection, *, min_age: float, limit: int) -> list[tuple[int, str]]:
    rows = await conn.execute(_STRANDED, dict(min_age=min_age, limit=limit))
    return [(r.client_id, r.key) for r in rows]


async def backlog(conn: AsyncConnection, *, min_age: float) -> Backlog:
    row = (await conn.execute(_BACKLOG, dict(min_age=min_age))).one()
    return Backlog(row.due, row.oldest_due_seconds, row.unfinished, row.parked)


async def _fenced(conn: AsyncConnection, statement, lease: Lease, **params) -> None:
    result = await conn.execute(
        statement, dict(client_id=lease.client_id, key=lease.key, token=lease.token, stored_on=lease.stored_on,
                        **params)
    )
    if result.rowcount != 1:
        raise LeaseLost(f"lease on {lease.key!r} was taken over; this attempt must stop")
