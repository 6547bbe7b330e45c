"""The payment's phases, each beside its statement: one transaction each, and no network.

The machine that orders them is app/payments/payment.py; read it first. A
phase is one SQL statement (app/machine/statements.py builds it from the
fence, the phase's own writes below and the outbox), run by the engine as a
transaction of its own. A phase returns the operation as it stands after its
commit; the engine makes the external calls between phases.

Each statement returns only what the database decided: Handler1 the key
row's lease and the payment's two timestamps, a later phase the columns its
UPDATE set (and the two its ledger legs read). Everything else about the
payment is what the phase already holds. While a payment is processing,
nothing but its lease's owner writes it. Once paid out, it is also
written by its client refunds (each reserves part of `refunded_minor`, and
gives it back if it fails), perhaps while a returned payout's
compensation owns it; that compensation runs CHARGE_REFUNDED
(app/payments/returns.py), which sets and returns `refunded_minor` and
`updated_at` itself. The whole row would say the same at a cost: the
database describes every column it returns, at every level of the
statement, on every call, and the driver decodes them all (an
optimisation: docs/reference/performance.md, "A phase returns what it
changed").

    handler1          claim the key, create the payment       -> EXT1_SENT
    record_charge     store the charge, post the ledger,
                      build the payout instruction            -> EXT2_SENT | finished (declined)
    record_transfer   store the transfer, post the ledger     -> finished | EXT3_SENT (rejected)
    record_refund     store the refund, reverse the ledger    -> finished (failed)

The payment-specific parts of parking (the payment becomes `indeterminate`,
with its event) and of taking a parked payment back are here too.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection
from uuid6 import uuid7

from app.idempotency.keys import derived_key, end_to_end_reference
from app.idempotency.key_table import KeyRow, Lease
from app.ledger import postings
from app.machine import engine
from app.machine.declare import Machine, Operation
from app.machine.statements import advance, claim, finish
from app.outbox import events
from app.payments import payment_table
from app.payments.models import Payment, PaymentRequest, PaymentView, fee_for
from app.payments.recovery_points import EXT1_SENT, EXT2_SENT, EXT3_SENT, STEP_CHARGE, STEP_REFUND, STEP_TRANSFER
from app.problems import DUPLICATE_PAYMENT, ProblemError
from app.rails.answers import Charge, Refund, Transfer

# Every final outcome, good or bad, is a payment resource that now exists, so
# it is answered 201 Created; its `status` says how it ended.
FINAL_STATUS_CODE = 201


def new_payment_id() -> uuid.UUID:
    """A time-ordered id (UUIDv7): new payments land at the right-hand edge of the
    primary key's index instead of on a random page of it, which keeps the index
    compact and writes fewer pages, and less WAL, per payment
    (docs/reference/performance.md has the measurement)."""
    return uuid7()


# --- Handler1: claim the key and create the payment -> EXT1_SENT ------------------------------------
#
# The claim is this phase's fence: claim_idempotency_key inserts the key row
# and returns its lease token, or, if the key exists in any day's partition,
# returns nothing, and then nothing else happens either. If the claim
# inserts a key row but the payment insert finds the reference already
# taken, the key row would name a payment that does not exist; its foreign
# key to payment is DEFERRABLE INITIALLY DEFERRED, so PostgreSQL checks it
# when the statement ends, refuses, and rolls the whole statement back,
# claim included: a duplicate reference leaves no trace.
#
# The payment is created with every column an index of `payment` names
# already final on the way to `succeeded`: its end-to-end reference (derived
# from the key, so known now, though the API shows it only once the payout
# is instructed) and `holds_reference`, which only a declined or failed
# payment gives up. So the two updates that follow, on the happy path, are
# HOT: PostgreSQL rewrites the row on its page and touches no index (an
# optimisation: migration 0014, and docs/reference/performance.md, "A
# payment row whose updates are HOT").
HANDLER1 = claim(
    "SELECT fence.lease_token, fence.stored_on AS key_stored_on, created.created_at, created.updated_at"
    " FROM fence, created",
    created="""
        INSERT INTO payment
            (id, client_id, reference, amount_minor, currency, fee_minor, net_minor,
             card_token, beneficiary_name, beneficiary_iban, status, psp_charge_key, end_to_end_reference)
        SELECT :id, :client_id, :reference, :amount_minor, :currency, :fee_minor, :net_minor,
               :card_token, :beneficiary_name, :beneficiary_iban, :status, :psp_charge_key, :end_to_end_reference
          FROM fence                                   -- only under a claim we won
        ON CONFLICT (client_id, reference) WHERE holds_reference DO NOTHING
        RETURNING created_at, updated_at
    """,
)


async def handler1(
    conn: AsyncConnection, machine: Machine[Payment], *, client_id: int, key: str, request_hash: bytes,
    request: PaymentRequest, lease_seconds: float,
) -> Operation[Payment] | None:
    """Claim the key and create the payment; None if the key already exists.

    Durable after commit: the key row (started, EXT1_SENT, our lease) and the
    payment row (processing, with its fee and the charge's derived key K1).
    Crash before commit: nothing of this request exists; a retry starts afresh.
    Crash after commit: the row says EXT1_SENT, so a resumer probes the PSP by
    K1 and charges (with K1) only if the PSP has never seen it.
    Running it again is safe: the claim finds the key and returns no row, and
    the caller reads the stored row instead.
    """
    fee = fee_for(request.amount)
    # The payment's columns as this phase writes them, by name.
    written = dict(
        id=new_payment_id(), client_id=client_id, reference=request.reference, amount_minor=request.amount,
        currency=request.currency, fee_minor=fee, net_minor=request.amount - fee, card_token=request.card_token,
        beneficiary_name=request.beneficiary.name, beneficiary_iban=request.beneficiary.iban, status="processing",
        psp_charge_key=derived_key(client_id, key, STEP_CHARGE),
        end_to_end_reference=end_to_end_reference(client_id, key),
    )
    try:
        row = await HANDLER1.fetch_one(
            conn,
            dict(
                written, key=key, endpoint=machine.endpoint, request_hash=request_hash,
                recovery_point=EXT1_SENT, payment_id=written["id"], lease_seconds=lease_seconds,
            ),
        )
    except IntegrityError as exc:
        if "idempotency_key_payment_id_fkey" not in str(exc.orig):
            raise
        # The reference is taken: the statement, claim included, was rolled
        # back, so retrying this gives the same answer.
        existing = await payment_table.id_by_reference(conn, client_id, request.reference)
        raise ProblemError(
            DUPLICATE_PAYMENT, f"payment {existing} already has reference {request.reference!r}",
            payment_id=str(existing),
        ) from None
    if row is None:
        return None
    lease = Lease(client_id, key, row["lease_token"], row["key_stored_on"])
    # What we wrote, with the timestamps the database chose; every other
    # column is the table's default, as Payment's are.
    payment = Payment(**written, created_at=row["created_at"], updated_at=row["updated_at"])
    return Operation(machine, lease, EXT1_SENT, payment, resumed=False)


# --- EXT1's outcome: the charge, then Handler2 -> EXT2_SENT | finished -----------------------------
#
# Each recording phase updates the one payment its key row names, found by
# `payment.id = (SELECT payment_id FROM fence)`: no row if the fence matched
# none. Written as a join (`FROM fence WHERE payment.id = fence.payment_id`)
# the planner sizes it by the fence's estimate, a row for every partition of
# the key table, and on a young payment table it hashes the fence and scans
# all of payment; a pooled connection keeps that plan while the table grows,
# until the next ANALYZE. The subquery is one value looked up in payment's
# primary key, whatever the sizes were when it was planned (an optimisation:
# docs/reference/performance.md, "Does the database's cost grow within a run?").

# The charge succeeded: record it, build the payout instruction, post charge_captured.
# The end-to-end reference is already this value for every payment created
# since migration 0014 (so the update stays HOT); setting it again gives one
# created before it, still at EXT1_SENT, its reference.
CHARGE_CAPTURED = advance(
    updated="""
        UPDATE payment
           SET psp_charge_id = :charge_id, end_to_end_reference = :e2e, rail_transfer_key = :transfer_key,
               payout_instructed_at = now(), updated_at = now()
         WHERE payment.id = (SELECT payment_id FROM fence)
        RETURNING id, currency, psp_charge_id, end_to_end_reference, rail_transfer_key, payout_instructed_at,
                  updated_at
    """,
    posted=postings.POSTED,
)

# The card was declined: the payment is over.
CHARGE_DECLINED = finish(
    updated="""
        UPDATE payment
           SET status = 'declined', holds_reference = false, psp_charge_id = :charge_id,
               decline_code = :decline_code, updated_at = now()
         WHERE payment.id = (SELECT payment_id FROM fence)
        RETURNING status, holds_reference, psp_charge_id, decline_code, updated_at
    """,
)


async def record_charge(
    conn: AsyncConnection, op: Operation[Payment], charge: Charge, lease_seconds: float
) -> Operation[Payment]:
    """External1's outcome, then Handler2, then the intent to call External2.

    Durable after commit, if the charge succeeded: the charge id, the ledger's
    `charge_captured` posting, the payout instruction (end-to-end reference
    and derived key K2) and recovery point EXT2_SENT. If it was declined: the
    decline and the stored final response (finished).
    Crash before commit: the row still says EXT1_SENT; the resumer's probe by
    K1 finds this same charge at the PSP and records it then.
    Crash after commit: the resumer starts at EXT2_SENT and never charges again.
    """
    client_id, key = op.lease.client_id, op.lease.key
    # `charge.status` is one of the PSP's documented final statuses: anything
    # else never got this far (app/rails/answers.py), so "not succeeded"
    # really is a decline.
    if charge.status == "declined":
        declined = replace(op.subject, status="declined", psp_charge_id=charge.id, decline_code=charge.decline_code)
        return await _finish(conn, op, CHARGE_DECLINED, declined, event="charge declined",
                             charge_id=charge.id, decline_code=charge.decline_code)
    return await engine.advance(
        conn, op, CHARGE_CAPTURED, EXT2_SENT, lease_seconds=lease_seconds, event="charge succeeded",
        charge_id=charge.id, e2e=end_to_end_reference(client_id, key),
        transfer_key=derived_key(client_id, key, STEP_TRANSFER),
        **postings.legs("charge_captured", postings.charge_captured(op.subject)),
    )


# --- EXT2's outcome: the transfer, then Handler3 -> finished | EXT3_SENT ---------------------------

# The rail accepted: the payment succeeded, post payout_sent.
PAYOUT_SENT = finish(
    updated="""
        UPDATE payment
           SET status = 'succeeded', rail_transfer_id = :transfer_id, updated_at = now()
         WHERE payment.id = (SELECT payment_id FROM fence)
        RETURNING id, currency, status, rail_transfer_id, updated_at
    """,
    posted=postings.POSTED,
)

# The rail rejected: intend the compensating refund, with its derived key K3.
PAYOUT_REJECTED = advance(
    updated="""
        UPDATE payment
           SET rail_transfer_id = :transfer_id, reject_reason = :reject_reason, psp_refund_key = :refund_key,
               updated_at = now()
         WHERE payment.id = (SELECT payment_id FROM fence)
        RETURNING rail_transfer_id, reject_reason, psp_refund_key, updated_at
    """,
)


async def record_transfer(
    conn: AsyncConnection, op: Operation[Payment], transfer: Transfer, lease_seconds: float
) -> Operation[Payment]:
    """External2's outcome, then Handler3 (or the intent to compensate).

    Durable after commit, if the rail accepted: the transfer id, the ledger's
    `payout_sent` posting, status succeeded and the stored response
    (finished). If the rail rejected: the reason, the refund's derived key K3
    and recovery point EXT3_SENT.
    Crash before commit: the row still says EXT2_SENT; the resumer probes the
    rail by end-to-end reference, finds this transfer and records it then.
    Crash after commit: nothing is left to do but replay (or refund).
    """
    if transfer.status == "accepted":
        paid = replace(op.subject, status="succeeded", rail_transfer_id=transfer.id)
        return await _finish(
            conn, op, PAYOUT_SENT, paid, event="transfer accepted", transfer_id=transfer.id,
            **postings.legs("payout_sent", postings.payout_sent(op.subject)),
        )
    # "rejected", the rail's only other documented final status: it will
    # never pay this out, so the charge is refunded.
    return await engine.advance(
        conn, op, PAYOUT_REJECTED, EXT3_SENT, lease_seconds=lease_seconds, event="transfer rejected",
        transfer_id=transfer.id, reject_reason=transfer.reject_reason,
        refund_key=derived_key(op.lease.client_id, op.lease.key, STEP_REFUND),
    )


# --- EXT3's outcome: the compensating refund -> finished (failed) ----------------------------------

# The charge refunded: the payment ends `failed` (its payout was rejected),
# or `refunded` (its payout was returned: app/payments/returns.py). Either
# way nothing of the charge is refundable any more. A failed payment gives
# its reference up (the order may be paid again); a refunded one moved money
# out and back, and keeps it (the CHECK payment_holds_reference_by_status
# refuses any other combination). `:status` is cast to text in both places:
# `status` is of the domain payment_status (migration 0017), and PostgreSQL
# refuses one parameter it would read as the domain in one place, text in the other.
CHARGE_REFUNDED = finish(
    updated="""
        UPDATE payment
           SET status = CAST(:status AS text), holds_reference = CAST(:status AS text) <> 'failed',
               psp_refund_id = :refund_id,
               refunded_minor = amount_minor, updated_at = now()
         WHERE payment.id = (SELECT payment_id FROM fence)
        RETURNING id, currency, status, holds_reference, psp_refund_id, refunded_minor, updated_at
    """,
    posted=postings.POSTED,
)


async def record_refund(
    conn: AsyncConnection, op: Operation[Payment], refund: Refund, lease_seconds: float
) -> Operation[Payment]:
    """The compensating refund's outcome: the payment ends failed, money returned.

    Durable after commit: the refund id, the ledger's `charge_refunded`
    posting (which balances `charge_captured` to zero), status failed and the
    stored response (finished).
    Crash before commit: the row still says EXT3_SENT; the resumer probes the
    PSP by K3, finds this refund and records it then: one refund, never two.
    """
    failed = replace(op.subject, status="failed", psp_refund_id=refund.id)
    return await _finish(
        conn, op, CHARGE_REFUNDED, failed, event="charge refunded", status=failed.status, refund_id=refund.id,
        **postings.legs("charge_refunded", postings.charge_refunded(op.subject)),
    )


async def _finish(conn: AsyncConnection, op: Operation[Payment], statement, final: Payment, *, event: str,
                  **values: Any) -> Operation[Payment]:
    # The response is built from the payment as it will be after this commit
    # (`final`), and stored by the same statement that makes it so; the
    # event a client must hear about carries the same text.
    return await engine.finish(
        conn, op, statement, status_code=FINAL_STATUS_CODE, body=PaymentView.of(final).body(), event=event,
        event_type=events.type_for(final.status), **values,
    )


# --- The payment as the engine sees it --------------------------------------------------------------


async def load(conn: AsyncConnection, row: KeyRow) -> Payment:
    """The payment a key row names (for an owner that takes it over)."""
    assert row.payment_id is not None
    payment = await payment_table.get(conn, row.client_id, row.payment_id)
    assert payment is not None
    return payment


async def indeterminate(conn: AsyncConnection, op: Operation[Payment]) -> Payment:
    """Parked: the payment is `indeterminate`, and the client hears so (`payment.indeterminate`)."""
    payment = await payment_table.update(conn, "indeterminate", op.subject.id)
    await events.emit(
        conn, client_id=payment.client_id, payment_id=payment.id,
        event_type=events.INDETERMINATE, data=PaymentView.of(payment).body(),
    )
    return payment


async def reopened(conn: AsyncConnection, op: Operation[Payment]) -> Payment:
    """Taken back from parking by someone who learned something: `processing` again."""
    return await payment_table.update(conn, "reopened", op.subject.id)


def log_fields(payment: Payment) -> dict[str, str]:
    return {"payment_id": str(payment.id)}
