"""fake-psp: a card payment service provider, the first external system.

The payment service charges a card here, and refunds it. Like a real PSP
(Stripe, Adyen) it dedupes every POST by `Idempotency-Key`, can be asked
whether a charge with a given key exists (the status probe a caller uses
after a timeout), and declines some cards: `tok_decline` is declined with
`card_declined`, `tok_insufficient_funds` with `insufficient_funds`.

A refund is refused (404/409, nothing recorded) for an unknown or declined
charge, or for more than the charge has left unrefunded.
"""

from __future__ import annotations

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
"""

DECLINED_TOKENS = {"tok_decline": "card_declined", "tok_insufficient_funds": "insufficient_funds"}

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


def create_app(database_url: str) -> FastAPI:
    app = base_app("fake-psp", database_url, "fake_psp", DDL, ["charge", "refund"])

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
                "SELECT coalesce(sum(amount), 0) FROM fake_psp.refund WHERE charge_id = $1",
                body.charge_id,
            )
            if body.amount > charge["amount"] - refunded:
                raise Problem(
                    409, "refund-exceeds-charge", "Refund exceeds charge",
                    f"{charge['amount'] - refunded} of {charge['amount']} left to refund",
                )
            resource = {
                "id": new_id("re"),
                "object": "refund",
                "status": "succeeded",
                **body.model_dump(),
                "idempotency_key": attempt.key,
                "created_at": utcnow(),
            }
            return await attempt.record(resource)

        return await idempotent_post(request, "refund", "fake_psp.refund", body, refund)

    async def probe(table: str, key: str) -> dict[str, Any]:
        response = await pool().fetchval(
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

    @app.get("/_admin/charges", tags=["admin"])
    async def admin_charges(reference: Annotated[str | None, Query()] = None) -> dict[str, Any]:
        return await list_items(pool(), "fake_psp.charge", reference)

    @app.get("/_admin/refunds", tags=["admin"])
    async def admin_refunds(reference: Annotated[str | None, Query()] = None) -> dict[str, Any]:
        return await list_items(pool(), "fake_psp.refund", reference)

    return app


def main() -> None:
    run_cli(create_app, default_port=8101)
