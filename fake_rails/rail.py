"""fake-rail: a bank payment rail (think SEPA credit transfer), the second external system.

The payment service pays out here. Like a real rail API it dedupes every POST
by `Idempotency-Key`, can be asked for a transfer by its end-to-end reference
(the status probe a caller uses after a timeout), may reject a transfer it
cannot deliver, and publishes a daily statement of what it booked, which the
payment service reconciles against its own ledger.

Two things make it behave like the rails a payment service really meets:

* **Legacy mode** (`--legacy`, or `--legacy-accounts IBAN,...` for the
  transfers to some beneficiary accounts only): the rail ignores
  `Idempotency-Key`, so a second POST is a second transfer, and it has no
  status probe.
* **Booking with a cut-off and closed days.** A transfer is booked on the
  first open day on or after the day it was accepted; a day closes when it is
  over, when it is closed explicitly (`POST /_admin/close-day`), and for the
  transfers accepted after the daily cut-off time. A closed day's statement is
  final and never changes.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from datetime import UTC, date, datetime, time, timedelta
from typing import Annotated, Any

import asyncpg
import typer
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from schwifty import IBAN
from schwifty.exceptions import SchwiftyException

from fake_rails import returns
from fake_rails.common import (
    DATABASE_URL_HELP,
    RECORD_COLUMNS,
    Attempt,
    CloseDayRequest,
    Outcome,
    Problem,
    base_app,
    database_url_or_exit,
    idempotent_post,
    iso,
    list_items,
    new_id,
    not_found,
    parse_day,
    serve_app,
    utcnow,
)

DDL = f"""
CREATE TABLE IF NOT EXISTS fake_rail.transfer (
    {RECORD_COLUMNS},
    status text NOT NULL,
    reject_reason text,
    end_to_end_reference text NOT NULL,
    amount bigint NOT NULL,
    currency text NOT NULL,
    beneficiary_iban text NOT NULL,
    beneficiary_name text NOT NULL,
    reference text NOT NULL,
    booking_date date,
    value_date date
);
CREATE INDEX IF NOT EXISTS transfer_end_to_end_reference_idx
    ON fake_rail.transfer (end_to_end_reference);
CREATE INDEX IF NOT EXISTS transfer_booking_date_idx ON fake_rail.transfer (booking_date);

-- Legacy transfers, added later: upgrades a table created before them.
-- A legacy transfer has no idempotency key (NULL: the UNIQUE constraint never
-- sees it, as NULLs do not conflict); the key the caller sent, if any, is kept
-- in presented_key (on every new transfer, legacy or not).
ALTER TABLE fake_rail.transfer
    ADD COLUMN IF NOT EXISTS legacy boolean NOT NULL DEFAULT false,
    ADD COLUMN IF NOT EXISTS presented_key text,
    ALTER COLUMN idempotency_key DROP NOT NULL;
DO $$
BEGIN
    IF NOT EXISTS (
        SELECT FROM pg_constraint
        WHERE conrelid = 'fake_rail.transfer'::regclass
          AND conname = 'transfer_key_unless_legacy'
    ) THEN
        ALTER TABLE fake_rail.transfer ADD CONSTRAINT transfer_key_unless_legacy
            CHECK (legacy OR idempotency_key IS NOT NULL);
    END IF;
END $$;

-- Days closed explicitly (POST /_admin/close-day); days before today are
-- closed without a row.
CREATE TABLE IF NOT EXISTS fake_rail.closed_day (
    day date PRIMARY KEY,
    closed_at timestamptz NOT NULL
);
"""

# Booking a transfer takes this advisory lock shared, closing a day takes it
# exclusive: a day cannot close while a transfer is being booked on it, and a
# transfer booked after the close sees it. So nothing is ever added to a
# closed day's statement.
# How far ahead the calendar may be moved (POST /_admin/close-day).
MAX_DAYS_AHEAD = timedelta(days=31)
BOOKING_LOCK = "SELECT pg_advisory_xact_lock{}(hashtext('fake_rail.closed_day'))"

DEFAULT_CUTOFF = time(23, 0)


class TransferRequest(BaseModel):
    # strict: "100" is not an amount, and unknown fields would escape the hash.
    model_config = ConfigDict(extra="forbid", strict=True)
    # 35 characters is the ISO 20022 limit for an end-to-end identification.
    end_to_end_reference: str = Field(min_length=1, max_length=35)
    amount: int = Field(gt=0)
    currency: str = Field(pattern=r"^[A-Z]{3}$")
    beneficiary_iban: str
    beneficiary_name: str
    reference: str


def booking_date_for(
    accepted_at: datetime, closed_days: Collection[date], cutoff: time | None
) -> date:
    """The day a transfer accepted at `accepted_at` (timezone-aware) is booked,
    and valued: the one place that decides it.

    The first day that is not closed, starting from the UTC date of
    `accepted_at`, or the day after it if the transfer was accepted at or after
    the `cutoff` (UTC; None: no cut-off). `closed_days` are the days closed
    explicitly; the days before today are closed too, but a transfer is
    accepted now, so its day is never one of them.
    """
    accepted_at = accepted_at.astimezone(UTC)
    day = accepted_at.date()
    if cutoff is not None and accepted_at.time() >= cutoff:
        day += timedelta(days=1)
    while day in closed_days:
        day += timedelta(days=1)
    return day


def parse_cutoff(value: str) -> time | None:
    """`HH:MM` (UTC) to a time; `24:00`, the end of the day, means no cut-off."""
    if value == "24:00":
        return None
    if re.fullmatch(r"\d{2}:\d{2}", value):
        try:
            return time.fromisoformat(value)
        except ValueError:
            pass
    raise ValueError(f"{value!r} is not a HH:MM time (00:00 to 23:59, or 24:00 for none)")


def electronic_iban(text: str) -> str:
    """An IBAN's electronic form (no spaces, upper case), valid or not: for comparing."""
    return IBAN(text, allow_invalid=True).compact


def legacy_iban(text: str) -> str:
    """A configured legacy account, validated (this rail is independent of the
    payment service's code, so it asks schwifty itself) and in electronic form."""
    try:
        return IBAN(text).compact
    except SchwiftyException as exc:
        raise ValueError(f"legacy account {text.strip()!r} is not a valid IBAN: {exc}") from None


def create_app(
    database_url: str,
    legacy: bool = False,
    legacy_accounts: Iterable[str] = frozenset(),
    cutoff: time | None = DEFAULT_CUTOFF,
    notify_url: str | None = None,
    notify_secret: str | None = None,
) -> FastAPI:
    """The rail. `legacy`: every transfer is legacy; `legacy_accounts`: the
    transfers to these beneficiary IBANs (compared in electronic form, so
    `GB82 WEST ...` and `GB82WEST...` are one account) are; `cutoff`: the
    daily cut-off time in UTC, None for none. An entry of `legacy_accounts`
    that is not a valid IBAN raises ValueError. `notify_url`, `notify_secret`:
    where returns are notified, and the shared secret they are signed with
    (fake_rails/returns.py; also settable with `PUT /_admin/notify`)."""
    legacy_accounts = frozenset(legacy_iban(a) for a in legacy_accounts if a.strip())
    app = base_app(
        "fake-rail", database_url, "fake_rail", DDL + returns.DDL, ["transfer", "notification"],
        background=returns.notifier,
    )
    app.state.notifier = returns.Notifier(notify_url, notify_secret)

    def pool() -> asyncpg.Pool:
        return app.state.pool

    def is_legacy(body: TransferRequest) -> bool:
        # Both sides in electronic form: a payout written in print form to a
        # legacy account is still legacy (an exact comparison would treat it
        # as deduplicated, and the rail would then honour a key it must not).
        return legacy or electronic_iban(body.beneficiary_iban) in legacy_accounts

    async def book(conn: asyncpg.Connection) -> tuple[datetime, date]:
        """Now, and the day a transfer accepted now is booked on."""
        await conn.execute(BOOKING_LOCK.format("_shared"))
        now = utcnow()
        closed = await conn.fetch(
            "SELECT day FROM fake_rail.closed_day WHERE day >= $1", now.date()
        )
        return now, booking_date_for(now, {r["day"] for r in closed}, cutoff)

    @app.post("/v1/transfers", status_code=201)
    async def create_transfer(body: TransferRequest, request: Request) -> JSONResponse:
        legacy_transfer = is_legacy(body)

        async def transfer(attempt: Attempt) -> Outcome:
            if replayed := await attempt.replay():  # never, for a legacy transfer
                return replayed
            rejected = attempt.fault is not None and attempt.fault.action == "reject"
            if rejected:
                now, booked = utcnow(), None
            else:
                now, booked = await book(attempt.conn)
            resource = {
                "id": new_id("tr"),
                "object": "transfer",
                "status": "rejected" if rejected else "accepted",
                "reject_reason": "account_closed" if rejected else None,
                **body.model_dump(),
                "idempotency_key": attempt.key,  # None for a legacy transfer
                "legacy": legacy_transfer,
                "booking_date": booked,
                "value_date": booked,
                "created_at": now,
            }
            return await attempt.record(resource, presented_key=attempt.presented_key)

        return await idempotent_post(
            request, "transfer", "fake_rail.transfer", body, transfer,
            honour_key=not legacy_transfer,
        )

    @app.get("/v1/transfers/{end_to_end_reference}")
    async def probe_transfer(end_to_end_reference: str) -> dict[str, Any]:
        if legacy:
            raise Problem(
                501, "no-status-probe", "No status probe", "no status probe on a legacy rail"
            )
        # Keys, not end-to-end references, are unique: if a caller reused a
        # reference under another key, the probe shows the first transfer.
        # A legacy transfer cannot be probed: it is not found.
        response = await pool().fetchval(
            "SELECT response FROM fake_rail.transfer "
            "WHERE end_to_end_reference = $1 AND NOT legacy ORDER BY created_at, id LIMIT 1",
            end_to_end_reference,
        )
        if response is None:
            raise not_found(f"transfer {end_to_end_reference!r}")
        return response

    async def is_closed(conn: asyncpg.Connection, day: date) -> bool:
        return day < utcnow().date() or await conn.fetchval(
            "SELECT EXISTS (SELECT FROM fake_rail.closed_day WHERE day = $1)", day
        )

    @app.get("/v1/statements/{day}")
    async def statement(day: str) -> dict[str, Any]:
        booking_date = parse_day(day)
        async with pool().acquire() as conn:
            # Closed first, entries second: if the day was closed, every
            # booking on it had committed by then, so the entries are complete.
            final = await is_closed(conn, booking_date)
            rows = await conn.fetch(
                "SELECT id, end_to_end_reference, amount, currency, booking_date, value_date "
                "FROM fake_rail.transfer WHERE status = 'accepted' AND booking_date = $1 "
                "ORDER BY created_at, id",
                booking_date,
            )
            returned = await returns.returns_booked(conn, booking_date)
        return {
            "date": day,
            "final": final,
            # Transfers returned, booked on this day (the transfer itself
            # stays on the statement of the day it was booked).
            "returns": returned,
            "entries": [
                {
                    "transfer_id": r["id"],
                    "end_to_end_reference": r["end_to_end_reference"],
                    "amount": r["amount"],
                    "currency": r["currency"],
                    "booking_date": r["booking_date"].isoformat(),
                    "value_date": r["value_date"].isoformat(),
                }
                for r in rows
            ],
        }

    @app.post("/_admin/close-day", tags=["admin"])
    async def close_day(body: CloseDayRequest) -> dict[str, Any]:
        day = parse_day(body.day)
        async with pool().acquire() as conn, conn.transaction():
            # Waits for the transfers being booked to commit (see BOOKING_LOCK).
            await conn.execute(BOOKING_LOCK.format(""))
            today = utcnow().date()
            if day > today + MAX_DAYS_AHEAD:
                raise Problem(
                    400, "future-day", "Too far ahead",
                    f"{day} is more than {MAX_DAYS_AHEAD.days} days after today ({today}, UTC)",
                )
            # Closing a future day moves the rail's calendar on: every open day
            # from today up to it closes too, as if that time had passed. It is
            # how tests and demos reach a final statement for tomorrow without
            # waiting a day. Closing a closed day again changes nothing.
            await conn.execute(
                "INSERT INTO fake_rail.closed_day (day, closed_at) "
                "SELECT d::date, $3 FROM generate_series(LEAST($1::date, $2::date), $1::date, interval '1 day') AS d "
                "WHERE d::date = $1::date OR d::date >= $2::date "
                "ON CONFLICT (day) DO NOTHING",
                day, today, utcnow(),
            )
            closed_at = await conn.fetchval(
                "SELECT closed_at FROM fake_rail.closed_day WHERE day = $1", day
            )
        return {"date": day.isoformat(), "closed_at": iso(closed_at)}

    @app.get("/_admin/closed-days", tags=["admin"])
    async def closed_days() -> dict[str, Any]:
        rows = await pool().fetch("SELECT day, closed_at FROM fake_rail.closed_day ORDER BY day")
        return {
            "items": [{"date": r["day"].isoformat(), "closed_at": iso(r["closed_at"])} for r in rows]
        }

    @app.get("/_admin/config", tags=["admin"])
    async def config() -> dict[str, Any]:
        return {
            "legacy": legacy,
            "legacy_accounts": sorted(legacy_accounts),
            "cutoff": cutoff.strftime("%H:%M") if cutoff else None,
        }

    @app.get("/_admin/transfers", tags=["admin"])
    async def admin_transfers(reference: Annotated[str | None, Query()] = None) -> dict[str, Any]:
        return await list_items(pool(), "fake_rail.transfer", reference)

    app.include_router(returns.router(app, book))

    return app


def _cutoff_option(value: str) -> time | None:
    try:
        return parse_cutoff(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def main() -> None:
    def serve(
        port: int = typer.Option(8102, help="Port to listen on."),
        host: str = typer.Option("127.0.0.1", help="Interface to bind."),
        database_url: str | None = typer.Option(None, help=DATABASE_URL_HELP),
        legacy: bool = typer.Option(
            False, "--legacy", help="Legacy rail: ignore Idempotency-Key, no status probe."
        ),
        legacy_accounts: str = typer.Option(
            "", help="Comma-separated beneficiary IBANs whose transfers are legacy."
        ),
        cutoff: str = typer.Option(
            "23:00", help="Daily cut-off, HH:MM UTC: later transfers book next day (24:00: none)."
        ),
        notify_url: str | None = typer.Option(
            None, help="Where returns are notified (the payment service's POST /v1/rail/notifications)."
        ),
        notify_secret: str | None = typer.Option(
            None, envvar="FAKE_RAIL_NOTIFY_SECRET",
            help="whsec_... secret the notifications are signed with (Standard Webhooks).",
        ),
    ) -> None:
        try:
            app = create_app(
                database_url_or_exit(database_url),
                legacy=legacy,
                legacy_accounts=legacy_accounts.split(","),
                cutoff=_cutoff_option(cutoff),
                notify_url=notify_url,
                notify_secret=notify_secret and returns.valid_secret(notify_secret),
            )
        except ValueError as exc:  # a legacy account that is not an IBAN
            raise typer.BadParameter(str(exc), param_hint="--legacy-accounts") from None
        serve_app(app, host, port)

    typer.run(serve)
