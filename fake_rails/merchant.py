"""fake-merchant: a client's webhook endpoint, the consumer side of the outbox.

The payment service POSTs every event of a client with a webhook endpoint
here (app/workers/webhooks.py), at least once. This is what a careful
merchant does with them:

* **Verify** the Standard Webhooks signature with the same library the
  sender signs with (`standardwebhooks`), against each secret it was given:
  a bad signature, a missing header or a timestamp more than five minutes
  off is answered 401 and nothing is applied.
* **Apply each event once, through an inbox**: the `webhook-id` (the event
  id) is inserted into `processed_message` in the same transaction as the
  effect (the merchant's own record of the payment). If the insert
  conflicts, the event was seen before: the delivery is acknowledged (200)
  and dropped. Two deliveries of one event at the same moment are serialised
  by the primary key: the second waits for the first to commit, then finds
  it.
* **Apply events in order of their ids**, not of arrival: a retried older
  event arriving after a newer one is recorded (counted in
  `events_applied`) without moving the status back.
* **Take several events in one POST** when its endpoint asked for them
  (`--events-per-post`): a body of type `event.list` lists each event with
  its own id; every one goes through the inbox in one transaction, and the
  answer covers them all. An event that comes again alone (a retry) is a
  duplicate like any other.

Every POST is logged as it arrives (`received`), with when and how it was
answered, so a test can prove two deliveries of one event never overlapped.
A fault plan (`/_admin/faults`, operation `webhook`, matched on the
payment's reference; a list POST on the first of its events' references
that has a plan) makes it misbehave like a real endpoint: `delay`,
`error_before` (an error, nothing applied), `error_after` (applied, then an
error: the sender must retry and the inbox absorbs it), `hang_after`
(applied, then no answer), `rate_limit` (429 with Retry-After).

Records live in PostgreSQL, schema `fake_merchant`.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import typer
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from standardwebhooks import Webhook, WebhookVerificationError

from fake_rails.common import DATABASE_URL_HELP, Problem, base_app, database_url_or_exit, iso, serve_app

SCHEMA = "fake_merchant"

DDL = """
CREATE TABLE IF NOT EXISTS fake_merchant.secret (
    secret text PRIMARY KEY,
    added_at timestamptz NOT NULL DEFAULT now()
);
-- The inbox: one row per message applied, inserted with its effect.
CREATE TABLE IF NOT EXISTS fake_merchant.processed_message (
    webhook_id text PRIMARY KEY,
    type text NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- The effect: what the merchant knows of each payment.
CREATE TABLE IF NOT EXISTS fake_merchant.payment (
    payment_id text PRIMARY KEY,
    reference text NOT NULL,
    status text NOT NULL,
    amount bigint,
    currency text,
    last_event_id text NOT NULL,
    last_event_type text NOT NULL,
    events_applied integer NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- Every POST to /webhooks, logged as it arrives and completed when answered.
CREATE TABLE IF NOT EXISTS fake_merchant.received (
    seq bigserial PRIMARY KEY,
    webhook_id text,
    webhook_timestamp text,
    reference text,
    received_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    answered_at timestamptz,
    status_code integer,
    -- applied | duplicate | rejected (bad signature) | fault | error
    outcome text
);
CREATE INDEX IF NOT EXISTS received_webhook_id_idx ON fake_merchant.received (webhook_id);
-- How many events the POST carried: 1, or a list POST's count.
ALTER TABLE fake_merchant.received ADD COLUMN IF NOT EXISTS events integer NOT NULL DEFAULT 1;
"""

# The inbox and the effect in one statement, so one transaction: the
# message id is inserted, and only if that insert took (`first` returned a
# row) is the payment written. A redelivery conflicts on the id and changes
# nothing; a second delivery arriving while the first is still in flight
# waits on the id's unique index until the first commits, then conflicts.
# When nothing is to follow (no fault plan after applying), the same
# statement also notes the answer in the POST's `received` row ($8): the
# answer it is about to give, 200, applied or duplicate.
_APPLY = """
WITH first AS (
    INSERT INTO fake_merchant.processed_message (webhook_id, type) VALUES ($6, $7)
    ON CONFLICT (webhook_id) DO NOTHING
    RETURNING webhook_id
), applied AS (
    INSERT INTO fake_merchant.payment AS p
        (payment_id, reference, status, amount, currency, last_event_id, last_event_type, events_applied)
    SELECT $1::text, $2::text, $3::text, $4::bigint, $5::text, $6, $7, 1 FROM first
    ON CONFLICT (payment_id) DO UPDATE
       SET events_applied = p.events_applied + 1,
           -- Only a newer event (a greater, time-ordered id) moves the status.
           status = CASE WHEN EXCLUDED.last_event_id > p.last_event_id THEN EXCLUDED.status ELSE p.status END,
           last_event_type = CASE WHEN EXCLUDED.last_event_id > p.last_event_id
                                  THEN EXCLUDED.last_event_type ELSE p.last_event_type END,
           last_event_id = greatest(p.last_event_id, EXCLUDED.last_event_id),
           updated_at = clock_timestamp()
), answered AS (
    UPDATE fake_merchant.received
       SET answered_at = clock_timestamp(), status_code = 200,
           outcome = CASE WHEN EXISTS (SELECT 1 FROM first) THEN 'applied' ELSE 'duplicate' END
     WHERE seq = $8
)
SELECT EXISTS (SELECT 1 FROM first)
"""


class SecretBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    secret: str = Field(pattern=r"^whsec_[A-Za-z0-9+/=]+$")


class SecretsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    secrets: list[str]


# The envelope of several events in one POST (app/outbox/delivery.py::list_body).
LIST_TYPE = "event.list"


def peek(body: bytes) -> tuple[int, list[str]]:
    """How many events the body carries (1 if it cannot be read), and their payments' references, for the
    log of POSTs and for matching the fault plan (read before, and whatever, the signature says): the
    event's, or each listed event's in a list POST. An event of no payment (a batch's) has no reference."""
    try:
        parsed = json.loads(body)
        data = parsed["data"]
        items = data["events"] if parsed.get("type") == LIST_TYPE else [parsed]
        references = [(item.get("data") or {}).get("reference") for item in items]
    except (ValueError, KeyError, TypeError, AttributeError):
        return 1, []
    return len(items), [r for r in references if isinstance(r, str)]


def _events(payload: dict[str, Any], webhook_id: str) -> list[tuple[str, dict[str, Any]]]:
    """Each event a verified webhook carries, as (its id, its envelope): itself, or a list POST's items."""
    if payload.get("type") != LIST_TYPE:
        return [(webhook_id, payload)]
    return [(str(item["id"]), item) for item in (payload.get("data") or {}).get("events") or []]


def verify(secrets: list[str], body: bytes, headers: dict[str, str]) -> dict[str, Any] | None:
    """The payload if the signature verifies with one of `secrets`; None otherwise."""
    for secret in secrets:
        try:
            return Webhook(secret).verify(body, headers)
        # The library raises its own error for a bad or stale signature, and
        # ValueError for a malformed header or body (no comma, bad base64, not UTF-8).
        except (WebhookVerificationError, ValueError):
            continue
    return None


def create_app(database_url: str, secrets: list[str] | None = None) -> FastAPI:
    app = base_app("fake-merchant", database_url, SCHEMA, DDL, ["webhook"])
    initial = [s for s in (secrets or []) if s]

    def pool():
        return app.state.pool

    # The secrets set over /_admin/secrets, read on first use and again by
    # the admin call that changes them: this process is their only writer,
    # and a query per webhook would be a good part of what it asks of its
    # database.
    app.state.secrets = None

    async def load_secrets() -> list[str]:
        app.state.secrets = [r["secret"] for r in await pool().fetch("SELECT secret FROM fake_merchant.secret")]
        return app.state.secrets

    async def secrets() -> list[str]:
        return initial + (app.state.secrets if app.state.secrets is not None else await load_secrets())

    @app.post("/webhooks")
    async def receive(request: Request) -> JSONResponse:
        body = await request.body()
        headers = dict(request.headers)
        events, references = peek(body)
        seq = await pool().fetchval(
            "INSERT INTO fake_merchant.received (webhook_id, webhook_timestamp, reference, events) "
            "VALUES ($1, $2, $3, $4) RETURNING seq",
            headers.get("webhook-id"), headers.get("webhook-timestamp"), references[0] if references else None,
            events,
        )
        status, outcome, noted = 500, "error", False
        try:
            response, outcome, noted = await _handle(seq, body, headers, references)
            status = response.status_code
            return response
        except Problem as problem:
            status = problem.status
            outcome = "rejected" if problem.status == 401 else "fault"
            raise
        finally:
            if not noted:
                await pool().execute(
                    "UPDATE fake_merchant.received SET answered_at = clock_timestamp(), status_code = $2, outcome = $3 "
                    "WHERE seq = $1",
                    seq, status, outcome,
                )

    async def _fault(references: list[str]):
        """The fault planned for the first of the references that has one (one use of it taken), or None."""
        for reference in references:
            if fault := await app.state.faults.take("webhook", reference):
                return fault
        return None

    async def _handle(
        seq: int, body: bytes, headers: dict[str, str], references: list[str]
    ) -> tuple[JSONResponse, str, bool]:
        """The answer, its outcome, and whether the apply statement has already noted it in `received`."""
        fault = await _fault(references)
        action = fault.action if fault else None
        if action == "delay":
            await asyncio.sleep(fault.seconds)
        elif action == "error_before":
            raise Problem(fault.status, "injected-error", "Injected error", "fault plan: error_before")
        elif action == "rate_limit":
            raise Problem(429, "rate-limited", "Too many requests", "fault plan: rate_limit",
                          headers={"Retry-After": str(int(fault.seconds or 1))})

        # The secrets it was started with (FAKE_MERCHANT_SECRETS), and those set over /_admin/secrets.
        payload = verify(await secrets(), body, headers)
        if payload is None:
            raise Problem(401, "invalid-signature", "Invalid signature",
                          "the webhook signature is missing, wrong or stale; nothing was applied")
        after = action in ("error_after", "hang_after")
        events = _events(payload, headers["webhook-id"])
        if payload.get("type") != LIST_TYPE:
            first = await _apply(*events[0], None if after else seq)
        else:
            # A list POST: every event it carries through the inbox, in one
            # transaction with the answer's note; each one applied once,
            # whichever of its deliveries (in a list, or alone) came first.
            async with pool().acquire() as conn, conn.transaction():
                applied = [await _apply(event_id, event, None, conn) for event_id, event in events]
                first = any(applied)
                if not after:
                    await conn.execute(
                        "UPDATE fake_merchant.received SET answered_at = clock_timestamp(), status_code = 200, "
                        "outcome = $2 WHERE seq = $1", seq, "applied" if first else "duplicate")
        outcome = "applied" if first else "duplicate"
        # Committed by now: what follows loses or delays the answer, not the effect.
        if first and action == "error_after":
            raise Problem(fault.status, "injected-error", "Injected error", "fault plan: error_after")
        if first and action == "hang_after":
            await asyncio.sleep(fault.seconds)
        return JSONResponse({"status": outcome}), outcome, not after

    async def _apply(event_id: str, event: dict[str, Any], seq: int | None, conn=None) -> bool:
        """One event through the inbox (`_APPLY`); True if this applied it, False if it was seen before."""
        data = event.get("data") or {}
        return await (conn or pool()).fetchval(
            _APPLY, str(data.get("id")), str(data.get("reference")), str(data.get("status")),
            data.get("amount"), data.get("currency"), event_id, str(event.get("type")), seq,
        )

    @app.get("/_admin/received", tags=["admin"])
    async def admin_received(webhook_id: str | None = None) -> dict[str, Any]:
        rows = await pool().fetch(
            "SELECT * FROM fake_merchant.received WHERE $1::text IS NULL OR webhook_id = $1 ORDER BY seq", webhook_id
        )
        return {"items": [_jsonable(r) for r in rows]}

    @app.get("/_admin/inbox", tags=["admin"])
    async def admin_inbox() -> dict[str, Any]:
        rows = await pool().fetch("SELECT * FROM fake_merchant.processed_message ORDER BY processed_at")
        return {"items": [_jsonable(r) for r in rows]}

    @app.get("/_admin/payments", tags=["admin"])
    async def admin_payments(reference: str | None = None) -> dict[str, Any]:
        rows = await pool().fetch(
            "SELECT * FROM fake_merchant.payment WHERE $1::text IS NULL OR reference = $1 ORDER BY updated_at",
            reference,
        )
        return {"items": [_jsonable(r) for r in rows]}

    @app.get("/_admin/secrets", tags=["admin"])
    async def admin_secrets() -> dict[str, Any]:
        return {"count": len(initial) + await pool().fetchval("SELECT count(*) FROM fake_merchant.secret")}

    @app.post("/_admin/secrets", tags=["admin"])
    async def add_secret(body: SecretBody) -> dict[str, Any]:
        await pool().execute("INSERT INTO fake_merchant.secret (secret) VALUES ($1) ON CONFLICT DO NOTHING", body.secret)
        await load_secrets()
        return await admin_secrets()

    @app.put("/_admin/secrets", tags=["admin"])
    async def replace_secrets(body: SecretsBody) -> dict[str, Any]:
        async with pool().acquire() as conn, conn.transaction():
            await conn.execute("DELETE FROM fake_merchant.secret")
            for secret in body.secrets:
                await conn.execute("INSERT INTO fake_merchant.secret (secret) VALUES ($1) ON CONFLICT DO NOTHING", secret)
        await load_secrets()
        return await admin_secrets()

    return app


def _jsonable(row) -> dict[str, Any]:
    return {k: iso(v) if hasattr(v, "isoformat") else v for k, v in dict(row).items()}


SECRETS_ENV = "FAKE_MERCHANT_SECRETS"


def main() -> None:
    def serve(
        port: int = typer.Option(8103, help="Port to listen on."),
        host: str = typer.Option("127.0.0.1", help="Interface to bind."),
        database_url: str | None = typer.Option(None, help=DATABASE_URL_HELP),
    ) -> None:
        # Secrets from the environment (comma-separated), never the command
        # line, where any user of the machine could read them (ps).
        secrets = [s.strip() for s in os.environ.get(SECRETS_ENV, "").split(",") if s.strip()]
        serve_app(create_app(database_url_or_exit(database_url), secrets), host, port)

    typer.run(serve)
