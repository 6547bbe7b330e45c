"""fake-psp: a card payment service provider, the first external system.

The payment service charges a card here, and refunds it. Like a real PSP
(Stripe, Adyen) it dedupes every POST by `Idempotency-Key`, can be asked
whether a charge with a given key exists (the status probe a caller uses
after a timeout), and declines some cards: `tok_decline` is declined with
`card_declined`, `tok_insufficient_funds` with `insufficient_funds`.

A refund is refused (404/409, nothing recorded) for an unknown or declined
charge, or for more than the charge has left unrefunded (its pending and
succeeded refunds count, its failed ones do not).

A refund is final at once (`succeeded`) unless the fault plan says
`pending`: then it settles later, to `succeeded` or `failed`. Settling is
lazy: every read (a probe, a replay, a listing, the settlement report)
first applies the settlements that are due, so what a caller sees depends
on the clock and the plan only, never on which request happened to come
first. The daily settlement report lists the refunds settled on a day,
final once the day is closed (the rail's calendar, on a small scale).
"""

from __future__ import annotations

from datetime import date, datetime, timedelta
from typing import Annotated, Any, Literal

import asyncpg
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from fake_rails.common import (
    RECORD_COLUMNS,
    Attempt,
    CloseDayRequest,
    FaultPlan,
    Outcome,
    Problem,
    base_app,
    idempotent_post,
    iso,
    list_items,
    new_id,
    not_found,
    parse_day,
    run_cli,
    utcnow,
)

DDL = f"""
CREATE TABLE IF NOT EXISTS fake_psp.charge (
    {RECORD_COLUMNS},
    status text NOT NULL,
    decline_code text,
    amount bigint NOT NULL,
    currency text NOT NULL,
    card_token text NOT NULL,
    reference text NOT NULL,
    description text
);
CREATE TABLE IF NOT EXISTS fake_psp.refund (
    {RECORD_COLUMNS},
    status text NOT NULL,
    charge_id text NOT NULL REFERENCES fake_psp.charge (id),
    amount bigint NOT NULL,
    reference text NOT NULL
);
CREATE INDEX IF NOT EXISTS refund_charge_id_idx ON fake_psp.refund (charge_id);

-- Pending refunds and the settlement report, added later: upgrades a table
-- created before them. A pending refund settles to settles_as at settles_at;
-- settled_at is when a refund became final (its creation, if it was final at
-- once), settlement_date the day whose report lists it.
ALTER TABLE fake_psp.refund
    ADD COLUMN IF NOT EXISTS failure_code text,
    ADD COLUMN IF NOT EXISTS settles_at timestamptz,
    ADD COLUMN IF NOT EXISTS settles_as text,
    ADD COLUMN IF NOT EXISTS settled_at timestamptz,
    ADD COLUMN IF NOT EXISTS settlement_date date,
    ADD COLUMN IF NOT EXISTS over_refund boolean NOT NULL DEFAULT false;
-- Refunds recorded before the report existed were final at creation.
UPDATE fake_psp.refund SET settled_at = created_at, settlement_date = (created_at AT TIME ZONE 'UTC')::date
    WHERE settled_at IS NULL AND status <> 'pending';
CREATE INDEX IF NOT EXISTS refund_settles_at_idx ON fake_psp.refund (settles_at) WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS refund_settlement_date_idx ON fake_psp.refund (settlement_date);

-- Days closed explicitly (POST /_admin/close-day); days before today are
-- closed without a row.
CREATE TABLE IF NOT EXISTS fake_psp.closed_day (
    day date PRIMARY KEY,
    closed_at timestamptz NOT NULL
);
"""

DECLINED_TOKENS = {"tok_decline": "card_declined", "tok_insufficient_funds": "insufficient_funds"}
# Why a pending refund failed: the card it would go back to no longer exists,
# the most common reason a real PSP gives.
REFUND_FAILURE_CODE = "expired_or_canceled_card"

# Settling a refund takes this advisory lock shared, closing a day takes it
# exclusive (as the rail's booking does): a day cannot close while a refund is
# being settled onto it, and a settlement after the close sees it. So nothing
# is ever added to a closed day's report.
SETTLING_LOCK = "SELECT pg_advisory_xact_lock{}(hashtext('fake_psp.closed_day'))"
MAX_DAYS_AHEAD = timedelta(days=31)

Amount = Annotated[int, Field(gt=0)]


class ChargeRequest(BaseModel):
    # strict: "100" is not an amount, and unknown fields would escape the hash.
    model_config = ConfigDict(extra="forbid", strict=True)
    amount: Amount
    currency: str = Field(pattern=r"^[A-Z]{3}$")
    card_token: str
    reference: str
    description: str | None = None


class RefundRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    charge_id: str
    amount: Amount
    reference: str


class SettleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    status: Literal["succeeded", "failed"]


# --- Settlement -----------------------------------------------------------------


async def settlement_day(conn: asyncpg.Connection, at: datetime) -> date:
    """The day whose report lists a refund settled at `at`: its UTC date, or
    the first open day after it if that day was closed already.

    Call with SETTLING_LOCK held (shared), so no day closes meanwhile.
    """
    day = at.date()
    closed = {
        r["day"] for r in await conn.fetch("SELECT day FROM fake_psp.closed_day WHERE day >= $1", day)
    }
    while day in closed:
        day += timedelta(days=1)
    return day


async def settle(conn: asyncpg.Connection, row: asyncpg.Record, status: str, at: datetime) -> dict[str, Any]:
    """Make the pending refund `row` final: columns and stored answer alike.

    The answer is edited in place, not rebuilt, so its keys keep their order
    and a probe or a replay shows the refund as it is now.
    """
    failure_code = REFUND_FAILURE_CODE if status == "failed" else None
    response = dict(row["response"]) | {"status": status, "failure_code": failure_code, "settled_at": iso(at)}
    await conn.execute(
        "UPDATE fake_psp.refund SET status = $2, failure_code = $3, settled_at = $4, "
        "settlement_date = $5, response = $6 WHERE id = $1",
        row["id"], status, failure_code, at, await settlement_day(conn, at), response,
    )
    return response


async def settle_due(conn: asyncpg.Connection) -> None:
    """Apply every settlement that is due, in the caller's transaction; the
    first thing every read of refunds does.

    A refund is settled as of its `settles_at`, not of the read that found
    it due: when it settles does not depend on when someone looked. Rows
    are locked, so two reads at once settle each refund once; the second
    waits, then finds it no longer pending. The shared lock is held until
    the caller commits, so a refund the caller goes on to create is also
    settled onto a day that cannot close under it.
    """
    await conn.execute(SETTLING_LOCK.format("_shared"))
    rows = await conn.fetch(
        "SELECT id, response, settles_at, settles_as FROM fake_psp.refund "
        "WHERE status = 'pending' AND settles_at <= $1 ORDER BY settles_at, id FOR UPDATE",
        utcnow(),
    )
    for row in rows:
        await settle(conn, row, row["settles_as"], row["settles_at"])


def create_app(database_url: str) -> FastAPI:
    app = base_app("fake-psp", database_url, "fake_psp", DDL, ["charge", "refund"])
    plan: FaultPlan = app.state.faults

    def pool():
        return app.state.pool

    @app.post("/v1/charges", status_code=201)
    async def create_charge(body: ChargeRequest, request: Request) -> JSONResponse:
        async def charge(attempt: Attempt) -> Outcome:
            if replayed := await attempt.replay():
                return replayed
            decline_code = DECLINED_TOKENS.get(body.card_token)
            if attempt.fault and attempt.fault.action == "decline":
                decline_code = "card_declined"
            resource = {
                "id": new_id("ch"),
                "object": "charge",
                "status": "declined" if decline_code else "succeeded",
                "decline_code": decline_code,
                **body.model_dump(exclude={"description"}),
                "idempotency_key": attempt.key,
                "created_at": utcnow(),
            }
            return await attempt.record(resource, description=body.description)

        return await idempotent_post(request, "charge", "fake_psp.charge", body, charge)

    @app.post("/v1/refunds", status_code=201)
    async def create_refund(body: RefundRequest, request: Request) -> JSONResponse:
        async def refund(attempt: Attempt) -> Outcome:
            # Locking the charge first serialises its refunds: two refunds with
            # different keys cannot both pass the balance check, and a refund
            # racing its own retry sees the retry's record in replay().
            charge = await attempt.conn.fetchrow(
                "SELECT status, amount FROM fake_psp.charge WHERE id = $1 FOR UPDATE",
                body.charge_id,
            )
            # Before the replay (it shows the refund as it is now) and the
            # balance (a refund that failed meanwhile gives its amount back).
            await settle_due(attempt.conn)
            if replayed := await attempt.replay():
                return replayed
            if charge is None:
                raise not_found(f"charge {body.charge_id}")
            if charge["status"] != "succeeded":
                raise Problem(
                    409, "charge-not-refundable", "Charge not refundable",
                    f"charge {body.charge_id} is {charge['status']}",
                )
            refunded = await attempt.conn.fetchval(
                "SELECT coalesce(sum(amount), 0) FROM fake_psp.refund "
                "WHERE charge_id = $1 AND status <> 'failed'",
                body.charge_id,
            )
            left = charge["amount"] - refunded
            # Taken apart from the request's one fault (common.SEPARATE_ACTIONS),
            # once per refund that reaches this check.
            unguarded = await plan.take("refund", body.reference, actions={"allow_over_refund"})
            if body.amount > left and unguarded is None:
                raise Problem(
                    409, "refund-exceeds-charge", "Refund exceeds charge",
                    f"{left} of {charge['amount']} left to refund",
                )
            now = utcnow()
            pending = attempt.fault if attempt.fault and attempt.fault.action == "pending" else None
            resource = {
                "id": new_id("re"),
                "object": "refund",
                "status": "pending" if pending else "succeeded",
                "failure_code": None,
                **body.model_dump(),
                "idempotency_key": attempt.key,
                "created_at": now,
                "settled_at": None if pending else now,
            }
            return await attempt.record(
                resource,
                settles_at=now + timedelta(seconds=pending.seconds) if pending else None,
                settles_as=pending.settles_as if pending else None,
                settlement_date=None if pending else await settlement_day(attempt.conn, now),
                over_refund=body.amount > left,
            )

        return await idempotent_post(request, "refund", "fake_psp.refund", body, refund)

    async def probe(table: str, key: str) -> dict[str, Any]:
        async with pool().acquire() as conn, conn.transaction():
            if table == "fake_psp.refund":
                await settle_due(conn)
            response = await conn.fetchval(
                f"SELECT response FROM {table} WHERE idempotency_key = $1", key
            )
        if response is None:
            raise not_found(f"{table.split('.')[1]} with idempotency key {key!r}")
        return response

    @app.get("/v1/charges")
    async def probe_charge(idempotency_key: str) -> dict[str, Any]:
        return await probe("fake_psp.charge", idempotency_key)

    @app.get("/v1/refunds")
    async def probe_refund(idempotency_key: str) -> dict[str, Any]:
        return await probe("fake_psp.refund", idempotency_key)

    async def is_closed(conn: asyncpg.Connection, day: date) -> bool:
        return day < utcnow().date() or await conn.fetchval(
            "SELECT EXISTS (SELECT FROM fake_psp.closed_day WHERE day = $1)", day
        )

    @app.get("/v1/settlements/{day}")
    async def settlement_report(day: str) -> dict[str, Any]:
        settlement_date = parse_day(day)
        async with pool().acquire() as conn, conn.transaction():
            # Under the shared lock settle_due takes: no day closes, and no
            # refund settles onto this one, between these reads.
            await settle_due(conn)
            final = await is_closed(conn, settlement_date)
            rows = await conn.fetch(
                "SELECT r.id, r.idempotency_key, r.charge_id, r.amount, c.currency, r.status, "
                "r.failure_code, r.settled_at "
                "FROM fake_psp.refund r JOIN fake_psp.charge c ON c.id = r.charge_id "
                "WHERE r.settlement_date = $1 ORDER BY r.settled_at, r.id",
                settlement_date,
            )
        return {
            "date": settlement_date.isoformat(),
            "final": final,
            "refunds": [
                {
                    "refund_id": r["id"],
                    "idempotency_key": r["idempotency_key"],
                    "charge_id": r["charge_id"],
                    "amount": r["amount"],
                    "currency": r["currency"],
                    "status": r["status"],
                    "failure_code": r["failure_code"],
                    "settled_at": iso(r["settled_at"]),
                }
                for r in rows
            ],
        }

    @app.post("/_admin/close-day", tags=["admin"])
    async def close_day(body: CloseDayRequest) -> dict[str, Any]:
        day = parse_day(body.day)
        async with pool().acquire() as conn, conn.transaction():
            # Waits for the settlements in progress to commit (SETTLING_LOCK).
            await conn.execute(SETTLING_LOCK.format(""))
            now = utcnow()
            if day > now.date() + MAX_DAYS_AHEAD:
                raise Problem(
                    400, "future-day", "Too far ahead",
                    f"{day} is more than {MAX_DAYS_AHEAD.days} days after today ({now.date()}, UTC)",
                )
            # What is due settles on the days it was due on, before they close:
            # a refund that settled before the close is on the day's report.
            await settle_due(conn)
            # As on the rail, closing a future day closes every open day from
            # today up to it; closing a closed day again changes nothing.
            await conn.execute(
                "INSERT INTO fake_psp.closed_day (day, closed_at) "
                "SELECT d::date, $3 FROM generate_series(LEAST($1::date, $2::date), $1::date, interval '1 day') AS d "
                "WHERE d::date = $1::date OR d::date >= $2::date "
                "ON CONFLICT (day) DO NOTHING",
                day, now.date(), now,
            )
            closed_at = await conn.fetchval("SELECT closed_at FROM fake_psp.closed_day WHERE day = $1", day)
        return {"date": day.isoformat(), "closed_at": iso(closed_at)}

    @app.get("/_admin/charges", tags=["admin"])
    async def admin_charges(reference: Annotated[str | None, Query()] = None) -> dict[str, Any]:
        return await list_items(pool(), "fake_psp.charge", reference)

    @app.get("/_admin/refunds", tags=["admin"])
    async def admin_refunds(reference: Annotated[str | None, Query()] = None) -> dict[str, Any]:
        async with pool().acquire() as conn, conn.transaction():
            await settle_due(conn)
            rows = await conn.fetch(
                "SELECT response, over_refund FROM fake_psp.refund "
                "WHERE $1::text IS NULL OR reference = $1 ORDER BY created_at, id",
                reference,
            )
        # The answer a caller got, plus what only the PSP knows: whether the
        # refund was recorded past the balance check (allow_over_refund).
        return {"items": [r["response"] | {"over_refund": r["over_refund"]} for r in rows]}

    @app.post("/_admin/refunds/{refund_id}/settle", tags=["admin"])
    async def admin_settle(refund_id: str, body: SettleRequest) -> dict[str, Any]:
        async with pool().acquire() as conn, conn.transaction():
            await settle_due(conn)  # a refund already due has settled as planned
            row = await conn.fetchrow(
                "SELECT id, status, response FROM fake_psp.refund WHERE id = $1 FOR UPDATE", refund_id
            )
            if row is None:
                raise not_found(f"refund {refund_id}")
            if row["status"] != "pending":
                raise Problem(
                    409, "refund-not-pending", "Refund not pending",
                    f"refund {refund_id} is {row['status']}",
                )
            return await settle(conn, row, body.status, utcnow())

    return app


def main() -> None:
    run_cli(create_app, default_port=8101)
