"""The fake rail's returns: a transfer sent back later, on the statement and by notification.

A beneficiary's bank may send an accepted payout back days later (the
account was closed, the name does not match): a *return*, with an ISO 20022
reason code. The rail then does two things, as real rails do:

* books it as a **return line** on the statement of the day it is booked
  (the first open day on or after the return, like a transfer);
* **notifies** the sender, at least once: a signed POST to the sender's
  notification URL, retried until the sender answers 2xx (a background task
  of the rail, `notifier`). Every attempt is recorded
  (`fake_rail.notification_attempt`), so a test can see how many deliveries
  the sender got and how each was answered.

The notification is signed with the Standard Webhooks scheme, by the same
library the payment service's outbox signs with (`standardwebhooks`):
`webhook-id` is the message id (the same on every delivery of one message),
`webhook-timestamp` the time of this delivery, `webhook-signature` the HMAC
under the shared secret (`whsec_...`), set with `--notify-secret` or
`PUT /_admin/notify`.

Under the fault plan (operation `notification`, matched on the transfer's
`reference`) the notifier misbehaves like a real one: `delay` holds a
delivery back (so a later notification arrives first: out of order) and
`duplicate` delivers a message once more after it was acknowledged.

`POST /_admin/return` takes any four-character reason code, known or not: a
real rail may send a code the receiver has never heard of, and the receiver
must refuse it rather than guess.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

import asyncpg
import httpx
from fastapi import APIRouter, FastAPI
from pydantic import BaseModel, ConfigDict, Field
from standardwebhooks import Webhook

from fake_rails.common import Problem, iso, new_id, utcnow

log = logging.getLogger(__name__)

DDL = """
CREATE TABLE IF NOT EXISTS fake_rail.transfer_return (
    id text PRIMARY KEY,
    -- One return per transfer: a transfer comes back once, if at all.
    transfer_id text NOT NULL UNIQUE,
    end_to_end_reference text NOT NULL,
    reference text NOT NULL,
    amount bigint NOT NULL,
    currency text NOT NULL,
    reason_code text NOT NULL,
    reason text NOT NULL,
    booking_date date NOT NULL,
    created_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS transfer_return_booking_date_idx ON fake_rail.transfer_return (booking_date);
-- The notifier's outbox: one message per return, delivered until answered 2xx.
CREATE TABLE IF NOT EXISTS fake_rail.notification (
    id text PRIMARY KEY,
    return_id text NOT NULL REFERENCES fake_rail.transfer_return (id),
    reference text NOT NULL,
    body jsonb NOT NULL,
    -- pending: to be (re)delivered at next_attempt_at; delivered: answered 2xx
    state text NOT NULL DEFAULT 'pending',
    attempts integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    delivered_at timestamptz,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS fake_rail.notification_attempt (
    notification_id text NOT NULL,
    attempt integer NOT NULL,
    started_at timestamptz NOT NULL,
    finished_at timestamptz NOT NULL,
    status_code integer,
    -- delivered | held (fault plan: delay) | http_status | timeout | connection
    outcome text NOT NULL,
    error text,
    PRIMARY KEY (notification_id, attempt)
);
"""

# The reasons a rail documents. Any other four-character code may be sent
# too (see the module docstring), with the reason "unspecified".
REASONS = {
    "AC01": "incorrect account number",
    "AC04": "account closed",
    "AC06": "account blocked",
    "AG01": "transaction forbidden on this account",
    "AM05": "duplication",
    "BE04": "missing creditor address",
    "MD07": "beneficiary deceased",
    "MS02": "not specified, reason by customer",
    "MS03": "not specified, reason by agent",
    "RR04": "regulatory reason",
}

# How soon a failed delivery is tried again: 0.25 s doubling to at most 5 s,
# for ever (a rail retries until it is answered; tests and demos want it quick).
RETRY_BASE_SECONDS = 0.25
RETRY_CAP_SECONDS = 5.0
# A duplicate (fault plan) is sent this long after the acknowledged delivery.
DUPLICATE_AFTER_SECONDS = 0.2
POLL_SECONDS = 0.1
TIMEOUT_SECONDS = 5.0


class ReturnRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    end_to_end_reference: str = Field(min_length=1, max_length=35)
    reason_code: str = Field(pattern=r"^[A-Z0-9]{4}$")


class NotifyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str | None = Field(default=None, pattern=r"^https?://")
    secret: str | None = Field(default=None, pattern=r"^whsec_[A-Za-z0-9+/=]+$")


@dataclass
class Notifier:
    """Where to deliver, and with which secret: in memory, like the fault plan."""

    url: str | None = None
    secret: str | None = None


def reason_for(code: str) -> str:
    return REASONS.get(code, "unspecified")


def return_line(r: asyncpg.Record) -> dict[str, Any]:
    """A return as the statement shows it."""
    return {
        "return_id": r["id"],
        "transfer_id": r["transfer_id"],
        "end_to_end_reference": r["end_to_end_reference"],
        "amount": r["amount"],
        "currency": r["currency"],
        "reason_code": r["reason_code"],
        "booking_date": r["booking_date"].isoformat(),
    }


async def returns_booked(conn: asyncpg.Connection, day: date) -> list[dict[str, Any]]:
    rows = await conn.fetch(
        "SELECT * FROM fake_rail.transfer_return WHERE booking_date = $1 ORDER BY created_at, id", day
    )
    return [return_line(r) for r in rows]


def router(app: FastAPI, book) -> APIRouter:
    """The admin side of returns: make one, list them, list notifications, set where they go.

    `book(conn)` is the rail's booking: (now, the day a booking made now lands on).
    """
    admin = APIRouter(prefix="/_admin", tags=["admin"])

    @admin.post("/return", status_code=201)
    async def make_return(body: ReturnRequest) -> dict[str, Any]:
        async with app.state.pool.acquire() as conn, conn.transaction():
            transfer = await conn.fetchrow(
                "SELECT id, reference, amount, currency, status FROM fake_rail.transfer "
                "WHERE end_to_end_reference = $1 AND status = 'accepted' ORDER BY created_at, id LIMIT 1",
                body.end_to_end_reference,
            )
            if transfer is None:
                raise Problem(404, "not-found", "Not found", f"no accepted transfer {body.end_to_end_reference!r}")
            now, booked = await book(conn)
            return_id = new_id("rt")
            inserted = await conn.fetchrow(
                "INSERT INTO fake_rail.transfer_return (id, transfer_id, end_to_end_reference, reference, amount, "
                "currency, reason_code, reason, booking_date, created_at) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) "
                "ON CONFLICT (transfer_id) DO NOTHING RETURNING *",
                return_id, transfer["id"], body.end_to_end_reference, transfer["reference"],
                transfer["amount"], transfer["currency"], body.reason_code, reason_for(body.reason_code),
                booked, now,
            )
            if inserted is None:
                raise Problem(409, "already-returned", "Already returned", f"transfer {transfer['id']} was returned already")
            message_id = new_id("msg")
            message = {
                "id": message_id,
                "type": "transfer.returned",
                "created_at": iso(now),
                "data": {**return_line(inserted), "reason": inserted["reason"], "returned_at": iso(now)},
            }
            await conn.execute(
                "INSERT INTO fake_rail.notification (id, return_id, reference, body) VALUES ($1, $2, $3, $4)",
                message_id, return_id, transfer["reference"], json.dumps(message),
            )
        return {**message["data"], "notification_id": message_id}

    @admin.get("/returns")
    async def list_returns() -> dict[str, Any]:
        rows = await app.state.pool.fetch("SELECT * FROM fake_rail.transfer_return ORDER BY created_at, id")
        return {"items": [return_line(r) | {"reason": r["reason"]} for r in rows]}

    @admin.get("/notifications")
    async def list_notifications() -> dict[str, Any]:
        pool = app.state.pool
        rows = await pool.fetch("SELECT * FROM fake_rail.notification ORDER BY created_at, id")
        attempts = await pool.fetch("SELECT * FROM fake_rail.notification_attempt ORDER BY started_at, attempt")
        by_id: dict[str, list[dict[str, Any]]] = {}
        for a in attempts:
            by_id.setdefault(a["notification_id"], []).append(
                {k: iso(v) if isinstance(v, datetime) else v for k, v in a.items() if k != "notification_id"}
            )
        return {
            "items": [
                {
                    "id": r["id"], "return_id": r["return_id"], "state": r["state"], "attempts": r["attempts"],
                    "delivered_at": r["delivered_at"] and iso(r["delivered_at"]),
                    "body": json.loads(r["body"]) if isinstance(r["body"], str) else r["body"],
                    "deliveries": by_id.get(r["id"], []),
                }
                for r in rows
            ]
        }

    @admin.get("/notify")
    async def get_notify() -> dict[str, Any]:
        n: Notifier = app.state.notifier
        return {"url": n.url, "secret_set": n.secret is not None}

    @admin.put("/notify")
    async def put_notify(body: NotifyConfig) -> dict[str, Any]:
        n: Notifier = app.state.notifier
        n.url, n.secret = body.url, body.secret
        return await get_notify()

    return admin


async def notifier(app: FastAPI) -> None:
    """The rail's background task: deliver every pending notification, until each is answered 2xx."""
    async with httpx.AsyncClient(timeout=TIMEOUT_SECONDS) as http:
        while True:
            try:
                await _deliver_due(app, http)
            except asyncio.CancelledError:
                raise
            except Exception:  # a lost database, say: try again next round
                log.exception("notifier round failed")
            await asyncio.sleep(POLL_SECONDS)


async def _deliver_due(app: FastAPI, http: httpx.AsyncClient) -> None:
    n: Notifier = app.state.notifier
    if n.url is None or n.secret is None:
        return  # nowhere to deliver yet: the messages wait, pending
    due = await app.state.pool.fetch(
        "SELECT id, reference, body, attempts FROM fake_rail.notification "
        "WHERE state = 'pending' AND next_attempt_at <= now() ORDER BY next_attempt_at, id LIMIT 20"
    )
    await asyncio.gather(*(_deliver(app, http, n.url, n.secret, row) for row in due))


async def _deliver(app: FastAPI, http: httpx.AsyncClient, url: str, secret: str, row: asyncpg.Record) -> None:
    pool: asyncpg.Pool = app.state.pool
    plan = app.state.faults
    attempt = row["attempts"] + 1
    started = utcnow()
    held = await plan.take("notification", row["reference"], actions=("delay",))
    if held is not None:
        await _record(pool, row["id"], attempt, started, None, "held", f"fault plan: delay {held.seconds} s",
                      retry_in=held.seconds)
        return
    body = row["body"] if isinstance(row["body"], str) else json.dumps(row["body"])
    signature = Webhook(secret).sign(row["id"], started, body)
    headers = {
        "content-type": "application/json",
        "webhook-id": row["id"],
        "webhook-timestamp": str(int(started.timestamp())),
        "webhook-signature": signature,
    }
    try:
        response = await http.post(url, content=body.encode(), headers=headers)
    except httpx.TimeoutException as exc:
        await _record(pool, row["id"], attempt, started, None, "timeout", repr(exc), retry_in=_backoff(attempt))
        return
    except httpx.HTTPError as exc:
        await _record(pool, row["id"], attempt, started, None, "connection", repr(exc), retry_in=_backoff(attempt))
        return
    if not 200 <= response.status_code < 300:
        await _record(pool, row["id"], attempt, started, response.status_code, "http_status",
                      response.text[:300], retry_in=_backoff(attempt))
        return
    again = await plan.take("notification", row["reference"], actions=("duplicate",))
    await _record(pool, row["id"], attempt, started, response.status_code, "delivered", None,
                  retry_in=DUPLICATE_AFTER_SECONDS if again else None)


def _backoff(attempt: int) -> float:
    return min(RETRY_CAP_SECONDS, RETRY_BASE_SECONDS * 2 ** (attempt - 1))


async def _record(
    pool: asyncpg.Pool, notification_id: str, attempt: int, started: datetime, status: int | None,
    outcome: str, error: str | None, *, retry_in: float | None,
) -> None:
    """The attempt, and what comes next: delivered (retry_in None) or again in `retry_in` seconds."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO fake_rail.notification_attempt "
            "(notification_id, attempt, started_at, finished_at, status_code, outcome, error) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING",
            notification_id, attempt, started, utcnow(), status, outcome, error,
        )
        if retry_in is None:
            await conn.execute(
                "UPDATE fake_rail.notification SET state = 'delivered', attempts = $2, delivered_at = now() "
                "WHERE id = $1",
                notification_id, attempt,
            )
        else:
            await conn.execute(
                "UPDATE fake_rail.notification SET attempts = $2, "
                "next_attempt_at = now() + make_interval(secs => $3) WHERE id = $1",
                notification_id, attempt, float(retry_in),
            )


def valid_secret(value: str) -> str:
    if not re.fullmatch(r"whsec_[A-Za-z0-9+/=]+", value):
        raise ValueError("a notification secret looks like whsec_<base64>")
    return value
