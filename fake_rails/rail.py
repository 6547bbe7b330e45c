"""fake-rail: a bank payment rail (think SEPA credit transfer), the second external system.

The payment service pays out here. Like a real rail API it dedupes every POST
by `Idempotency-Key`, can be asked for a transfer by its end-to-end reference
(the status probe a caller uses after a timeout), may reject a transfer it
cannot deliver, and publishes a daily statement of what it booked, which the
payment service reconciles against its own ledger. A statement for a past day
is final; today's may still grow.
"""

from __future__ import annotations

import re
from datetime import UTC, date, datetime
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from fake_rails.common import (
    RECORD_COLUMNS,
    Attempt,
    Outcome,
    Problem,
    base_app,
    idempotent_post,
    list_items,
    new_id,
    not_found,
    run_cli,
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
"""


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


def booking_date_for(accepted_at: datetime) -> date:
    """The day a transfer accepted at `accepted_at` is booked (and valued).

    The one place that decides it, so a cut-off time can be added here.
    """
    return accepted_at.astimezone(UTC).date()


def parse_day(day: str) -> date:
    # fromisoformat alone would also take "20250102" and week dates.
    try:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", day):
            return date.fromisoformat(day)
    except ValueError:
        pass
    raise Problem(400, "invalid-date", "Invalid date", f"{day!r} is not a YYYY-MM-DD date")


def create_app(database_url: str) -> FastAPI:
    app = base_app("fake-rail", database_url, "fake_rail", DDL, ["transfer"])

    def pool():
        return app.state.pool

    @app.post("/v1/transfers", status_code=201)
    async def create_transfer(body: TransferRequest, request: Request) -> JSONResponse:
        async def transfer(attempt: Attempt) -> Outcome:
            if replayed := await attempt.replay():
                return replayed
            now = utcnow()
            rejected = attempt.fault is not None and attempt.fault.action == "reject"
            booked = None if rejected else booking_date_for(now)
            resource = {
                "id": new_id("tr"),
                "object": "transfer",
                "status": "rejected" if rejected else "accepted",
                "reject_reason": "account_closed" if rejected else None,
                **body.model_dump(),
                "idempotency_key": attempt.key,
                "booking_date": booked,
                "value_date": booked,
                "created_at": now,
            }
            return await attempt.record(resource)

        return await idempotent_post(request, "transfer", "fake_rail.transfer", body, transfer)

    @app.get("/v1/transfers/{end_to_end_reference}")
    async def probe_transfer(end_to_end_reference: str) -> dict[str, Any]:
        # Keys, not end-to-end references, are unique: if a caller reused a
        # reference under another key, the probe shows the first transfer.
        response = await pool().fetchval(
            "SELECT response FROM fake_rail.transfer WHERE end_to_end_reference = $1 "
            "ORDER BY created_at, id LIMIT 1",
            end_to_end_reference,
        )
        if response is None:
            raise not_found(f"transfer {end_to_end_reference!r}")
        return response

    @app.get("/v1/statements/{day}")
    async def statement(day: str) -> dict[str, Any]:
        booking_date = parse_day(day)
        rows = await pool().fetch(
            "SELECT id, end_to_end_reference, amount, currency, booking_date, value_date "
            "FROM fake_rail.transfer WHERE status = 'accepted' AND booking_date = $1 "
            "ORDER BY created_at, id",
            booking_date,
        )
        return {
            "date": day,
            "final": booking_date < utcnow().date(),
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

    @app.get("/_admin/transfers", tags=["admin"])
    async def admin_transfers(reference: Annotated[str | None, Query()] = None) -> dict[str, Any]:
        return await list_items(pool(), "fake_rail.transfer", reference)

    return app


def main() -> None:
    run_cli(create_app, default_port=8102)
