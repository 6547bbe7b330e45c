"""Webhook delivery: read or claim, POST signed, record. At least once, so the receiver deduplicates.

Where it sits: after the commit, off every request's path. A phase wrote the
event with the decision (app/outbox/events.py); the dispatcher in `payments
worker` (app/workers/webhooks.py) delivers it, and nothing else does, in
one of two ways.

A first attempt comes from the events themselves: `take` (one statement,
committed before anything is sent) leases the cursor (`webhook_cursor`) and
reads the events after it, `post` sends each, and `move` (one statement,
fenced by the cursor's lease) moves the cursor past them and writes each
one's delivery row as its attempt left it, with the attempt's row. No row
is written for a webhook before its first attempt, and none is updated on
the way to `delivered`.

A retry comes from its delivery row: `claim` (one statement, committed:
leased, the attempt counted), `post`, and `record` (one statement, each row
fenced by its lease token). A first attempt still in flight when its batch
moves the cursor gets a leased row and is recorded that way too.

An endpoint may ask for several events in one POST (`events_per_post`,
migration 0019): `together` puts a batch's first attempts for it in lists,
and `post_list` sends each list as one signed message whose answer is each
listed event's. A retry is always one event in one POST.

`post` signs with `standardwebhooks` (both signatures during a rotation's
overlap), holds no transaction and no pooled connection, and sends through
the dispatcher's own HTTP/1.1 client (http1.py), which connects only where
the egress policy (egress.py) permits. `decide` says what an answer
leads to. docs/outbox-inbox.md#4-delivery-claim-post-record explains the
cursor, the lease, the retry schedule, and what a crash leaves.
"""

from __future__ import annotations

import functools
import json
import random
import ssl
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection
from standardwebhooks import Webhook

from app.db import driver
from app.outbox import egress, http1
from app.outbox.endpoints import MAX_EVENTS_PER_POST
from app.outbox.events import AFTER_THE_CURSOR
from app.outbox.sealing import SecretsKey

USER_AGENT = "exactly-once-payments-webhooks/0.1"
# The longest answer body read to its end (http1.py); a longer one is left
# unread and its connection closed.
MAX_BODY_READ = 64 * 1024

# Outcomes of an attempt, and the delivery state each leaves.
DELIVERED, RETRY, DEAD, CANCELLED = "delivered", "retry", "dead", "cancelled"
_STATE = {DELIVERED: "delivered", RETRY: "pending", DEAD: "dead", CANCELLED: "cancelled"}


class LeaseLost(Exception):
    """Another dispatcher claimed this delivery after our lease ran out: we record nothing."""


@dataclass(frozen=True)
class Claimed:
    """A delivery this dispatcher holds the lease on, with what it needs to POST it."""

    event_id: uuid.UUID
    client_id: int
    attempt: int  # counting every claim since the delivery was created
    due_attempt: int  # counting since the schedule (re)started: what the give-up compares
    lease_token: uuid.UUID
    url: str | None  # None: the client has no endpoint any more
    secret: str | None  # in the clear; None: no endpoint, or WEBHOOK_SECRETS_KEY cannot open it
    type: str
    data: str  # the event's payload, the JSON text its row holds
    created_at: datetime
    previous_secret: str | None = None  # a rotated-out secret, within its overlap window
    events_per_post: int = 1  # at most how many of the endpoint's events one POST may carry

    def body(self) -> str:
        """The webhook's body, the Standard Webhooks envelope; the same text on every attempt.

        The payload goes in as the text the event row holds, not decoded
        and encoded again: the same bytes, for less of the dispatcher's CPU.
        """
        return f'{{"type":{json.dumps(self.type)},"timestamp":"{self.timestamp()}","data":{self.data}}}'

    def listed(self) -> str:
        """The event as one item of a list POST (`list_body`): its envelope, with its id first."""
        return f'{{"id":"{self.event_id}",{self.body()[1:]}'

    def timestamp(self) -> str:
        return self.created_at.isoformat().replace("+00:00", "Z")


# Several events in one POST, for an endpoint that asked for it
# (`events_per_post` above 1, migration 0019): the envelope's type, and the
# namespace of its id, a uuid5 of the events' ids in their order, so that the
# same list is the same message and any other list another
# (docs/outbox-inbox.md#several-events-in-one-post). What it is for: a POST
# costs the dispatcher the same whatever it carries
# (docs/reference/performance.md#several-events-in-one-post-2026-12-05).
LIST_TYPE = "event.list"
LIST_NAMESPACE = uuid.UUID("6f0c2d4e-9a55-4b1e-8f53-3c1a7f2b9e10")


def together(to_send: list[Claimed]) -> list[list[Claimed]]:
    """A batch's first attempts as the POSTs that carry them, in the batch's order.

    An endpoint that takes several events in one POST gets its events in
    lists of at most its `events_per_post`; every other event goes alone.
    Only first attempts are sent together: a retry is always one event,
    the message every endpoint takes.
    """
    posts: list[list[Claimed]] = []
    filling: dict[int, list[Claimed]] = {}  # each endpoint's list still taking events
    for claimed in to_send:
        if claimed.events_per_post <= 1:
            posts.append([claimed])
            continue
        current = filling.get(claimed.client_id)
        if current is None or len(current) == claimed.events_per_post:
            current = filling[claimed.client_id] = []
            posts.append(current)
        current.append(claimed)
    return posts


def list_body(events: list[Claimed]) -> str:
    """The body of a list POST: one envelope of type LIST_TYPE whose data lists each event's, with its id.

    Its timestamp is the newest event's: when the last thing it tells of happened.
    """
    items = ",".join(c.listed() for c in events)
    return f'{{"type":"{LIST_TYPE}","timestamp":"{events[-1].timestamp()}","data":{{"events":[{items}]}}}}'


def list_id(events: list[Claimed]) -> str:
    """The `webhook-id` of a list POST: the same for the same events in the same order, and for no other list."""
    return "list_" + str(uuid.uuid5(LIST_NAMESPACE, ",".join(str(c.event_id) for c in events)))


@dataclass(frozen=True)
class Answer:
    """What one POST came to."""

    status_code: int | None  # None: no HTTP answer
    latency_ms: float
    error_class: str | None  # None: delivered (2xx)
    error: str | None = None
    retry_after: float | None = None


@dataclass(frozen=True)
class Decision:
    outcome: str
    retry_in: float = 0.0


_CLAIM = text(
    """
    WITH due AS (
        SELECT event_id
          FROM webhook_delivery
         WHERE state = 'pending' AND next_attempt_at <= now()
         ORDER BY next_attempt_at
         LIMIT :limit
           FOR UPDATE SKIP LOCKED
    ), claimed AS (
        UPDATE webhook_delivery d
           SET lease_token = gen_random_uuid(),
               lease_expires_at = now() + make_interval(secs => :lease_seconds),
               -- Not due again until the lease runs out: then it is claimed
               -- again, as if this dispatcher had died (it may have).
               next_attempt_at = now() + make_interval(secs => :lease_seconds),
               attempts = d.attempts + 1,
               updated_at = now()
          FROM due
         WHERE d.event_id = due.event_id
        RETURNING d.event_id, d.client_id, d.attempts, d.attempts - d.schedule_from AS due_attempt, d.lease_token
    ), target AS (
        SELECT claimed.*, w.url, w.secret_sealed,
               CASE WHEN w.previous_secret_until > now() THEN w.previous_secret_sealed END AS previous_secret_sealed
          FROM claimed LEFT JOIN webhook_endpoint w ON w.client_id = claimed.client_id
    ), started AS (
        INSERT INTO webhook_attempt (event_id, attempt, url)
        SELECT event_id, attempts, url FROM target
    )
    SELECT target.event_id, target.client_id, target.attempts AS attempt, target.due_attempt,
           target.lease_token, target.url, target.secret_sealed, target.previous_secret_sealed,
           e.type, CAST(e.data AS text) AS data, e.created_at
      FROM target JOIN event e ON e.id = target.event_id
    """
)

# The first attempts: lease the cursor and read the events after it, in the
# order of the transactions that wrote them. Only events of transactions
# older than every one still running are read (`pg_snapshot_xmin`): none of
# those can commit any more, so the cursor never moves past an event that
# becomes visible later. The cursor is leased only when there is something
# to read and nobody holds it, and only if it is still where this statement
# read it from: the UPDATE waits for a dispatcher moving it at the same
# moment and then looks at the row again, so two dispatchers never hold a
# batch at once, nor read the same one in turn. The batch ends before the
# first event it has no slot for (:sendable slots): every event returned
# moves the cursor; only those of a client with an endpoint, and no
# delivery row yet, are sent (a row exists if a person asked for a delivery
# first, or a service of the previous revision wrote one).
_TAKE = text(
    f"""
    -- The cursor's row is read here and in each AFTER_THE_CURSOR below: one
    -- statement, one snapshot, so all of them see the same position.
    WITH position AS (
        SELECT written_by, event_id FROM webhook_cursor
    ), taken AS (
        UPDATE webhook_cursor c
           SET lease_token = gen_random_uuid(),
               lease_expires_at = now() + make_interval(secs => :lease_seconds)
          FROM position
         WHERE (c.lease_expires_at IS NULL OR c.lease_expires_at <= now())
           AND (c.written_by, c.event_id) = (position.written_by, position.event_id)
           -- Something to read: the first event the batch below reads. In
           -- the index's order, with LIMIT 1, so that it is one step into
           -- the index from the position (as an EXISTS, PostgreSQL may look
           -- for it with a scan of the whole table).
           AND (SELECT e.id
                  FROM event e
                 WHERE {AFTER_THE_CURSOR}
                   AND e.written_by < pg_snapshot_xmin(pg_current_snapshot())
                 ORDER BY e.written_by, e.id
                 LIMIT 1) IS NOT NULL
        RETURNING c.lease_token
    ), counted AS (
        SELECT e.*, w.url, w.secret_sealed, w.events_per_post,
               CASE WHEN w.previous_secret_until > now() THEN w.previous_secret_sealed END AS previous_secret_sealed,
               d.event_id IS NOT NULL AS has_delivery,
               count(*) FILTER (WHERE w.url IS NOT NULL AND d.event_id IS NULL)
                   OVER (ORDER BY e.written_by, e.id) AS sendable_so_far
          FROM (
              -- The cursor's position as a value (AFTER_THE_CURSOR), so that
              -- it is where the index scan starts; joined to it, it would
              -- filter every event.
              SELECT e.written_by, e.id, e.client_id, e.type, e.data, e.created_at
                FROM event e
               WHERE {AFTER_THE_CURSOR}
                 AND e.written_by < pg_snapshot_xmin(pg_current_snapshot())
               ORDER BY e.written_by, e.id
               LIMIT :limit
          ) e
          LEFT JOIN webhook_endpoint w ON w.client_id = e.client_id
          -- LATERAL with LIMIT, so that each event's delivery row is looked
          -- up by its key. As an EXISTS, PostgreSQL may plan one hashed scan
          -- of every delivery row instead (it did, with a read's plan made
          -- for any :limit), and a read then costs the table's history.
          -- Only for an event whose client has an endpoint: no other is sent.
          LEFT JOIN LATERAL (
              SELECT d.event_id FROM webhook_delivery d
               WHERE d.event_id = e.id AND w.client_id IS NOT NULL
               LIMIT 1
          ) d ON true
    )
    -- An optimisation: only the events the batch passes over or sends come
    -- back, those up to its :sendable-th webhook to send and the ones passed
    -- over after it. The running count only grows, so PostgreSQL stops at
    -- the first event past the last slot (the WindowAgg's "Run Condition"):
    -- the events after it are neither looked up nor decoded, and the next
    -- read starts with them
    -- (docs/reference/performance.md#the-read-stops-at-its-last-slot-2026-12-05).
    SELECT taken.lease_token, counted.written_by, counted.id AS event_id, counted.client_id, counted.type,
           CASE WHEN counted.url IS NOT NULL THEN CAST(counted.data AS text) END AS data, counted.created_at,
           counted.url, counted.secret_sealed, counted.previous_secret_sealed, counted.events_per_post,
           counted.has_delivery
      FROM taken, counted
     WHERE counted.sendable_so_far <= :sendable
     ORDER BY counted.written_by, counted.id
    """
)

# The batch's end, fenced by the cursor's lease: the cursor moves past the
# events read and its lease is let go, and each attempt made gets its
# delivery row as the attempt left it, with its attempt row; all or nothing,
# and nothing at all if the lease was taken over meanwhile (the new holder
# reads the batch again). An attempt still in flight gets a pending row
# leased to this dispatcher (its task records it with `record`, as a
# retry's); one that finished, a row in its final state, or pending until
# its retry is due. The attempts come as one array of `webhook_answer` rows
# (`_answer_rows`).
_MOVE = text(
    """
    WITH moved AS (
        UPDATE webhook_cursor c
           SET written_by = CAST(:written_by AS xid8),
               event_id = CAST(:event_id AS uuid),
               lease_token = NULL,
               lease_expires_at = NULL,
               moved_at = now()
         WHERE c.lease_token = :token
        RETURNING 1
    ), answer AS (
        SELECT a.*
          FROM unnest(CAST(:answers AS webhook_answer[])) AS a
         WHERE EXISTS (SELECT FROM moved)
    ), delivery AS (
        INSERT INTO webhook_delivery
            (event_id, client_id, state, attempts, next_attempt_at, lease_token, lease_expires_at,
             last_status, last_error, delivered_at)
        SELECT a.event_id, a.client_id, a.state, 1,
               -- In flight (no outcome yet): not due again until the lease
               -- runs out, exactly as a claim leaves a retry.
               now() + make_interval(secs => CASE WHEN a.outcome IS NULL THEN :lease_seconds ELSE a.retry_in END),
               CASE WHEN a.outcome IS NULL THEN a.lease_token END,
               CASE WHEN a.outcome IS NULL THEN now() + make_interval(secs => :lease_seconds) END,
               a.status_code, a.error, CASE WHEN a.state = 'delivered' THEN now() END
          FROM answer a
        -- A person's redelivery made a row after the read: theirs stands.
        ON CONFLICT (event_id) DO NOTHING
        RETURNING event_id
    ), attempted AS (
        INSERT INTO webhook_attempt
            (event_id, attempt, url, started_at, finished_at, outcome, status_code, latency_ms, error_class, error)
        SELECT a.event_id, 1, a.url,
               now() - make_interval(secs => coalesce(a.latency_ms, 0) / 1000),
               CASE WHEN a.outcome IS NOT NULL THEN now() END,
               a.outcome, a.status_code, a.latency_ms, a.error_class, a.error
          FROM answer a JOIN delivery USING (event_id)
    )
    SELECT count(*) AS moved FROM moved
    """
)

# Every attempt that finished since the last record, in one statement
# (app/workers/webhooks.py::Recorder), as one array of `webhook_answer`
# rows (`_answer_rows`). Each row is fenced by its own lease token, exactly
# as if it were recorded alone; a row whose lease was taken over writes
# nothing and is missing from what the statement returns.
_RECORD = text(
    """
    WITH answer AS (
        SELECT * FROM unnest(CAST(:answers AS webhook_answer[]))
    ), fence AS (
        UPDATE webhook_delivery d
           SET state = a.state,
               lease_token = NULL,
               lease_expires_at = NULL,
               next_attempt_at = now() + make_interval(secs => a.retry_in),
               last_status = a.status_code,
               last_error = a.error,
               delivered_at = CASE WHEN a.state = 'delivered' THEN now() END,
               updated_at = now()
          FROM answer a
         WHERE d.event_id = a.event_id AND d.lease_token = a.lease_token AND d.state = 'pending'
        RETURNING d.event_id, d.attempts
    )
    UPDATE webhook_attempt w
       SET finished_at = now(), outcome = a.outcome, status_code = a.status_code, latency_ms = a.latency_ms,
           error_class = a.error_class, error = a.error
      FROM fence f JOIN answer a ON a.event_id = f.event_id
     WHERE w.event_id = f.event_id AND w.attempt = f.attempts
    RETURNING w.event_id
    """
)

# A person asks for another round: a dead (or delivered, or cancelled)
# delivery is pending again, due now, with a fresh schedule. An event
# written before its client had an endpoint gets its first delivery.
_REDELIVER = text(
    """
    INSERT INTO webhook_delivery (event_id, client_id)
    SELECT e.id, e.client_id
      FROM event e JOIN webhook_endpoint w ON w.client_id = e.client_id
     WHERE e.id = :event_id
    ON CONFLICT (event_id) DO UPDATE
       SET state = 'pending', next_attempt_at = now(), schedule_from = webhook_delivery.attempts,
           delivered_at = NULL, last_error = NULL, updated_at = now()
     WHERE webhook_delivery.state <> 'pending'
    RETURNING event_id
    """
)
_DELIVERY = text(
    """
    SELECT d.*, e.type, e.payment_id, w.url AS endpoint_url
      FROM event e
      LEFT JOIN webhook_delivery d ON d.event_id = e.id
      LEFT JOIN webhook_endpoint w ON w.client_id = e.client_id
     WHERE e.id = :event_id
    """
)
_LIST = text(
    """
    SELECT d.event_id, d.client_id, c.name AS client, e.type, d.state, d.attempts, d.last_status,
           d.last_error, d.next_attempt_at, d.updated_at
      FROM webhook_delivery d JOIN event e ON e.id = d.event_id JOIN client c ON c.id = d.client_id
     WHERE CAST(:state AS text) IS NULL OR d.state = :state
     ORDER BY d.event_id DESC
     LIMIT :limit
    """
)
_ATTEMPTS = text(
    "SELECT * FROM webhook_attempt WHERE event_id = :event_id ORDER BY attempt"
)
# Pending retries, and the events after the cursor waiting for a first attempt.
_BACKLOG = text(
    f"""
    SELECT (SELECT count(*) FROM webhook_delivery WHERE state = 'pending')
         + (SELECT count(*)
              FROM event e JOIN webhook_endpoint w ON w.client_id = e.client_id
             WHERE {AFTER_THE_CURSOR}
               AND NOT EXISTS (SELECT FROM webhook_delivery d WHERE d.event_id = e.id))
    """
)


# The two statements of a batch of first attempts, each a lone statement in
# AUTOCOMMIT, go to asyncpg itself past SQLAlchemy's execution when the
# engine allows it: an optimisation (app/db/driver.py, measured in
# docs/reference/performance.md#a-webhook-post-without-aiohttp).
_TAKE_POSITIONAL = driver.Positional.of(_TAKE)
_MOVE_POSITIONAL = driver.Positional.of(_MOVE)


@dataclass(frozen=True)
class Batch:
    """Events read behind the cursor by the dispatcher now holding its lease."""

    token: uuid.UUID  # the cursor's lease, which `move` is fenced by
    written_by: int  # the last event passed: its transaction and id, where the cursor moves
    last_event_id: uuid.UUID
    to_send: list[Claimed]  # of a client with an endpoint, without a delivery row yet
    full: bool  # more may be waiting right now: read again without a pause


# How many events a read may look at for each event it may send: events of
# clients without an endpoint are passed over, and should not leave a
# batch's slots unused. It stops at the first event past those it asked
# for, so where most events are webhooks to send it looks at few more than
# it sends; whatever it does not return stays in the database and is read
# again next time.
READ_AHEAD = 4


async def take(conn: AsyncConnection, *, limit: int, per_post: float = 1.0, lease_seconds: float,
               key: SecretsKey) -> Batch | None:
    """Lease the cursor and read the events after it, for up to `limit` POSTs; None: nothing new, or another holds it.

    How many events `limit` POSTs carry depends on whose events they are:
    one each, or a list of up to its endpoint's `events_per_post`
    (`together`). The statement reads up to `limit` × `per_post` events to
    send (the caller's guess of what a POST will carry), and the batch ends
    before the first event that would open a POST past `limit`, or the
    first the statement did not return; the cursor moves past exactly the
    events passed over or sent. `full`: more may be waiting (the POSTs or
    the events to send ran out, or it read as many events as it may look
    at).
    """
    sendable = min(max(limit, round(limit * per_post)), limit * MAX_EVENTS_PER_POST)
    read = sendable * READ_AHEAD
    rows = await driver.fetch_all(conn, _TAKE, _TAKE_POSITIONAL,
                                  dict(limit=read, sendable=sendable, lease_seconds=lease_seconds))
    if not rows:
        return None
    token = rows[0]["lease_token"]
    # No endpoint: the client reads GET /v1/events; a removed endpoint's
    # events are not sent (as its pending deliveries are cancelled).
    candidates = {r["event_id"]: Claimed(
        event_id=r["event_id"], client_id=r["client_id"], attempt=1, due_attempt=1, lease_token=token,
        url=r["url"], type=r["type"], data=r["data"], created_at=r["created_at"],
        secret=r["secret_sealed"] and key.open_cached(r["secret_sealed"]),
        previous_secret=r["previous_secret_sealed"] and key.open_cached(r["previous_secret_sealed"]),
        events_per_post=r["events_per_post"],
    ) for r in rows if r["url"] is not None and not r["has_delivery"]}
    posts = together(list(candidates.values()))
    kept = rows
    if len(posts) > limit:  # the batch ends before the event that opens the first POST past its slots
        first_past = posts[limit][0].event_id
        kept = rows[:next(i for i, r in enumerate(rows) if r["event_id"] == first_past)]
    last = kept[-1]
    return Batch(token, last["written_by"], last["event_id"],
                 [candidates[r["event_id"]] for r in kept if r["event_id"] in candidates],
                 full=len(posts) > limit or len(candidates) == sendable or len(rows) == read)


async def move(conn: AsyncConnection, batch: Batch, finished: list[Attempted], in_flight: list[Claimed], *,
               lease_seconds: float) -> bool:
    """Move the cursor past `batch`, writing each attempt's rows; False: its lease was taken over, nothing written."""
    answers = _answer_rows([(a.claimed, a.answer, a.decision) for a in finished]
                           + [(c, None, None) for c in in_flight])
    [row] = await driver.fetch_all(
        conn, _MOVE, _MOVE_POSITIONAL,
        dict(token=batch.token, written_by=batch.written_by, event_id=batch.last_event_id,
             lease_seconds=lease_seconds, answers=answers),
    )
    return row["moved"] == 1


async def claim(conn: AsyncConnection, *, limit: int, lease_seconds: float, key: SecretsKey) -> list[Claimed]:
    """Lease up to `limit` due deliveries (none that another dispatcher holds), their secrets opened with `key`."""
    rows = await conn.execute(_CLAIM, dict(limit=limit, lease_seconds=lease_seconds))
    claimed = []
    for row in rows.mappings():
        row = dict(row)
        sealed, previous = row.pop("secret_sealed"), row.pop("previous_secret_sealed")
        claimed.append(Claimed(**row, secret=sealed and key.open_cached(sealed),
                               previous_secret=previous and key.open_cached(previous)))
    return claimed


@dataclass(frozen=True)
class Attempted:
    """One finished attempt, waiting to be recorded: the delivery, what the POST came to, what follows."""

    claimed: Claimed
    answer: Answer
    decision: Decision


async def record(conn: AsyncConnection, attempts: list[Attempted]) -> set[uuid.UUID]:
    """Each attempt's outcome and its delivery's next state, in one statement; the event ids recorded.

    An event id missing from the result was claimed again after this
    dispatcher's lease on it ran out: nothing of that attempt was written
    (the caller raises LeaseLost for it).
    """
    if not attempts:
        return set()
    answers = _answer_rows([(a.claimed, a.answer, a.decision) for a in attempts])
    rows = await conn.execute(_RECORD, dict(answers=answers))
    return {row.event_id for row in rows}


def _answer_rows(attempts: list[tuple[Claimed, Answer | None, Decision | None]]) -> list[tuple]:
    """Each attempt as a `webhook_answer` row (migration 0018), in the type's order of fields; no answer and
    no decision: still in flight.

    An optimisation: one array of rows, where there were ten arrays side by
    side, one per field. asyncpg asks of every element of an array parameter
    whether it is an array itself, and that question cost the dispatcher more
    than the values' encoding; it is now asked once per attempt
    (docs/reference/performance.md#a-batchs-outcomes-as-one-array-of-rows-2026-12-05).
    """
    return [
        (c.event_id, c.lease_token, c.client_id, c.url,
         _STATE[d.outcome] if d else "pending", d.outcome if d else None, d.retry_in if d else 0.0,
         a.status_code if a else None, a.latency_ms if a else None, a.error_class if a else None,
         a.error if a else None)
        for c, a, d in attempts
    ]


async def redeliver(conn: AsyncConnection, event_id: uuid.UUID) -> bool:
    """Make the event's delivery pending and due now; False if it is pending already or cannot be delivered."""
    return (await conn.execute(_REDELIVER, dict(event_id=event_id))).one_or_none() is not None


async def delivery(conn: AsyncConnection, event_id: uuid.UUID) -> dict[str, Any] | None:
    """The event's delivery row (its columns None if it has none), its type and the endpoint's URL; None: no such event."""
    row = (await conn.execute(_DELIVERY, dict(event_id=event_id))).mappings().one_or_none()
    return None if row is None else dict(row)


async def attempts(conn: AsyncConnection, event_id: uuid.UUID) -> list[dict[str, Any]]:
    return [dict(r) for r in (await conn.execute(_ATTEMPTS, dict(event_id=event_id))).mappings()]


async def deliveries(conn: AsyncConnection, state: str | None, limit: int) -> list[dict[str, Any]]:
    """The newest deliveries, of one state or all."""
    return [dict(r) for r in (await conn.execute(_LIST, dict(state=state, limit=limit))).mappings()]


async def backlog(conn: AsyncConnection) -> int:
    """Webhooks not yet delivered or given up: pending retries, and events waiting for a first attempt."""
    return (await conn.execute(_BACKLOG)).scalar_one()


def signed_headers(claimed: Claimed, body: str, now: datetime, message_id: str | None = None) -> dict[str, str]:
    """The Standard Webhooks headers for this attempt, signed by the library, never by hand.

    The message's id is the event's, or `message_id` (a list POST's,
    `list_id`). Within a rotation's overlap window, signed with both
    secrets, the new one first: a receiver that verifies with either accepts it.
    """
    assert claimed.secret is not None
    message_id = message_id or str(claimed.event_id)
    secrets = (claimed.secret,) if claimed.previous_secret is None else (claimed.secret, claimed.previous_secret)
    signature = " ".join(_signer(s).sign(message_id, now, body) for s in secrets)
    return {
        "webhook-id": message_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signature,
        "content-type": "application/json",
        "user-agent": USER_AGENT,
    }


@functools.lru_cache(maxsize=256)
def _signer(secret: str) -> Webhook:
    """The library's signer for one secret, made once (it decodes the secret's base64 when made)."""
    return Webhook(secret)


def session(*, max_connections: int, policy: egress.EgressPolicy) -> http1.Client:
    """The dispatcher's HTTP client (http1.py), at most `max_connections` connections open, connecting only
    to the addresses `policy` permits, trusting its CAs (egress.py). Use as `async with`: it closes them."""
    return http1.Client(max_connections=max_connections, policy=policy, max_body_read=MAX_BODY_READ)


async def post(http: http1.Client, claimed: Claimed, timeout: float) -> Answer:
    """POST the event to the endpoint; what came of it. Never raises for a failed exchange.

    Only the status matters (and Retry-After). Redirects are not followed (a
    moved endpoint is registered again). The timeout is total, connecting
    included: it is what keeps a POST shorter than the lease, so that no
    delivery is ever in flight twice.
    """
    body = claimed.body()
    return await _exchange(http, claimed.url, body, signed_headers(claimed, body, datetime.now(UTC)), timeout)


async def post_list(http: http1.Client, events: list[Claimed], timeout: float) -> Answer:
    """POST several events of one endpoint in one message (`list_body`); what came of it, for each of them.

    The endpoint's answer is the answer to every event the list carries: a
    2xx delivers them all, anything else leaves each to its own retry, as
    one event alone.
    """
    body = list_body(events)
    headers = signed_headers(events[0], body, datetime.now(UTC), message_id=list_id(events))
    return await _exchange(http, events[0].url, body, headers, timeout)


async def _exchange(http: http1.Client, url: str | None, body: str, headers: dict[str, str],
                    timeout: float) -> Answer:
    assert url is not None
    started = time.perf_counter()
    try:
        head = await http.post(url, body.encode(), headers, timeout)
    except TimeoutError as exc:
        return Answer(None, _since(started), "timeout", _describe(exc, "no answer within the timeout"))
    except egress.RefusedAddress:
        # Nothing was sent: one phrase, whatever is (or is not) there.
        return Answer(None, _since(started), "refused_address", egress.REFUSED)
    except ssl.SSLError as exc:  # before OSError, which it is too
        return Answer(None, _since(started), "tls", _describe(exc))
    except (OSError, ValueError) as exc:
        # Refused, reset, closed without an answer, not HTTP, a URL that
        # cannot be posted to, a name that does not resolve (or that IDNA
        # cannot encode): no answer to go by.
        return Answer(None, _since(started), "connection", _describe(exc))
    latency = _since(started)
    status = head.status
    if 200 <= status < 300:
        return Answer(status, latency, None)
    error_class = "rate_limited" if status == 429 else "http_status"
    return Answer(status, latency, error_class, f"HTTP {status}", _retry_after(head.retry_after))


def decide(answer: Answer | None, due_attempt: int, *, max_attempts: int, base: float, cap: float) -> Decision:
    """What becomes of the delivery after attempt `due_attempt` of its schedule. `answer` None: no endpoint."""
    if answer is None:
        return Decision(CANCELLED)
    if answer.error_class is None:
        return Decision(DELIVERED)
    if due_attempt >= max_attempts:
        return Decision(DEAD)
    wait = backoff_seconds(due_attempt, base, cap)
    if answer.retry_after is not None and answer.status_code in (429, 503):
        wait = min(max(wait, answer.retry_after), cap)
    return Decision(RETRY, wait)


def backoff_seconds(attempt: int, base: float, cap: float) -> float:
    """About base * 2^(attempt-1), capped; the jitter (a random half) spreads out a burst of failures."""
    ceiling = min(cap, base * 2 ** (attempt - 1))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


def schedule(max_attempts: int, base: float, cap: float) -> list[float]:
    """The longest wait after each failed attempt before the last (jitter makes each 50-100% of it)."""
    return [min(cap, base * 2 ** (n - 1)) for n in range(1, max_attempts)]


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds, from delay-seconds or an HTTP date; None if absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, (parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds())
    except (TypeError, ValueError):
        return None


def _since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)


def _describe(exc: Exception, empty: str = "") -> str:
    """The error as stored in the attempt row and shown to operators; `empty` if the exception says nothing."""
    return f"{type(exc).__name__}: {str(exc) or empty}"[:300]
