"""THE NAIVE TWIN: the same payment flow with none of the protections. A counter-example.

It does the same business work as the real service, with the same request
model, authentication, fee, HTTP client, fake PSP and rail, and the same rows
(in the `naive` schema): insert the payment, charge the card, record it and
post the ledger, pay out, record it and post the ledger. What it leaves out
is everything that makes a retry safe:

    - no Idempotency-Key and no key table: a retry is a new payment;
    - no recovery points and no leases: a crash between steps is forgotten,
      and nobody finishes or even notices the half-done payment;
    - a fresh random key on every call to the PSP and the rail, so they cannot
      recognise a retry either;
    - no uniqueness of the client's reference.

So a client that retries after a lost response (a timeout, a crash after the
charge) is charged twice. `make demo-naive-crash` shows it; the real service's
answer to the same crash is in docs/crash-matrix.md. Its only other use is
`make bench`, which measures the real service against it.
"""

from __future__ import annotations

import os
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Response
from sqlalchemy import text

from app.api import errors
from app.api.deps import ClientId, ServicesDep
from app.config import Settings
from app.db.transaction import one_statement
from app.idempotency.keys import end_to_end_reference
from app.ledger import postings
from app.main import NO_TELEMETRY
from app.payments.models import Payment, PaymentRequest, PaymentView, fee_for
from app.payments.phases import new_payment_id
from app.rails.outcomes import Applied
from app.services import open_services

_INSERT = text(
    """
    INSERT INTO naive.payment
        (id, client_id, reference, amount_minor, currency, fee_minor, net_minor, card_token,
         beneficiary_name, beneficiary_iban, status)
    VALUES (:id, :client_id, :reference, :amount, :currency, :fee, :net, :card_token,
            :beneficiary_name, :beneficiary_iban, 'processing')
    RETURNING *
    """
)
_CHARGED = text(
    """
    UPDATE naive.payment SET psp_charge_id = :charge_id, end_to_end_reference = :e2e,
                             payout_instructed_at = now(), updated_at = now()
     WHERE id = :id RETURNING *
    """
)
_PAID = text(
    "UPDATE naive.payment SET status = 'succeeded', rail_transfer_id = :transfer_id, updated_at = now() "
    "WHERE id = :id RETURNING *"
)
_DECLINED = text(
    "UPDATE naive.payment SET status = 'declined', psp_charge_id = :charge_id, decline_code = :code, "
    "updated_at = now() WHERE id = :id RETURNING *"
)
_POST = text(
    """
    INSERT INTO naive.ledger_entry (payment_id, posting, account, debit_minor, credit_minor, currency)
    SELECT CAST(:payment_id AS uuid), CAST(:posting AS text), leg.account, leg.debit, leg.credit,
           CAST(:currency AS char(3))
      FROM unnest(CAST(:accounts AS text[]), CAST(:debits AS bigint[]), CAST(:credits AS bigint[]))
           AS leg(account, debit, credit)
    """
)


async def _one(conn, statement, **params) -> Payment:
    return Payment(**(await conn.execute(statement, params)).mappings().one())


async def _post(conn, payment: Payment, posting: str, entries) -> None:
    await conn.execute(_POST, dict(payment_id=payment.id, currency=payment.currency, **postings.legs(posting, entries)))


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    # For the crash demo: die right after the PSP charged the card.
    crash_after_charge = os.environ.get("NAIVE_CRASH_AFTER_CHARGE") == "1"

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with open_services(settings) as services:
            app.state.services = services
            yield

    app = FastAPI(title="THE NAIVE TWIN (unsafe, for comparison only)", lifespan=lifespan, telemetry=NO_TELEMETRY)
    errors.install(app)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/payments", status_code=201)
    async def create_payment(services: ServicesDep, client_id: ClientId, body: PaymentRequest) -> Response:
        engine = services.engine
        fee = fee_for(body.amount)
        # Each write commits on its own, as naive code does: a crash in
        # between leaves whatever happened to be written so far.
        payment = await one_statement(
            engine, _one, _INSERT, id=new_payment_id(), client_id=client_id, reference=body.reference,
            amount=body.amount, currency=body.currency, fee=fee, net=body.amount - fee, card_token=body.card_token,
            beneficiary_name=body.beneficiary.name, beneficiary_iban=body.beneficiary.iban,
        )
        # A fresh key every time: the PSP cannot tell a retry from a new charge.
        charge = await services.psp.charge(str(uuid.uuid4()), payment)
        if crash_after_charge:
            os._exit(137)
        if not isinstance(charge, Applied):
            return Response(status_code=502)  # and the payment stays "processing" forever
        if charge.record.status != "succeeded":
            payment = await one_statement(engine, _one, _DECLINED, id=payment.id, charge_id=charge.record.id,
                                 code=charge.record.decline_code)
            return Response(PaymentView.of(payment).body(), 201, media_type="application/json")
        payment = await one_statement(engine, _one, _CHARGED, id=payment.id, charge_id=charge.record.id,
                             e2e=end_to_end_reference(client_id, str(payment.id)))
        await one_statement(engine, _post, payment, "charge_captured", postings.charge_captured(payment))
        transfer = await services.rail.transfer(str(uuid.uuid4()), payment)
        if not isinstance(transfer, Applied) or transfer.record.status != "accepted":
            return Response(status_code=502)  # no refund either: the counter-example stops here
        payment = await one_statement(engine, _one, _PAID, id=payment.id, transfer_id=transfer.record.id)
        await one_statement(engine, _post, payment, "payout_sent", postings.payout_sent(payment))
        return Response(PaymentView.of(payment).body(), 201, media_type="application/json")

    return app
