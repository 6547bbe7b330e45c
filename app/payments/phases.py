"""The atomic phases of a payment: one function per transaction.

A phase returns what the caller needs after its commit (mostly the operation
as it now stands). The phases on
every payment's path (handler1, record_charge, record_transfer, record_refund)
are each a single SQL statement, written out whole in app/payments/sql.py,
run by `app.db.transaction.one_statement`; the rarer ones (take_over, park,
unpark, settle_parked) are a few statements in a transaction (`atomic`), and
release is one fenced UPDATE. Every phase after handler1 (whose claim is its fence)
first writes to the key row with its lease token, which proves this attempt
still owns the operation and locks the row; if the lease was taken over,
nothing the phase would have written is written, and `LeaseLost` is raised.
No phase calls the network: the runner calls the PSP and the rail between
phases.

    handler1          claim the key, create the payment      -> EXT1_SENT
    (External1: charge the card at the PSP with K1)
    record_charge     store the charge, post the ledger,
                      build the payout instruction           -> EXT2_SENT | finished (declined)
    (External2: send the transfer to the rail with K2)
    record_transfer   store the transfer, post the ledger     -> finished | EXT3_SENT (rejected)
    (External3: refund the charge at the PSP with K3)
    record_refund     store the refund, reverse the ledger    -> finished (failed)

A payout returned later is compensated by an operation of its own, started
by app/payments/returns.py::record_return at EXT4_SENT:

    (External4: refund the charge at the PSP with K4)
    record_return_refund  store the refund, reverse the ledger -> finished (refunded)
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection
from uuid6 import uuid7

from app.idempotency import store as keys
from app.idempotency.keys import derived_key, end_to_end_reference
from app.idempotency.store import Lease, LeaseLost
from app.ledger import postings
from app.outbox import events
from app.payments import sql
from app.payments import store as payments
from app.payments.models import Payment, PaymentRequest, PaymentView, fee_for
from app.payments.recovery_points import (
    EXT1_SENT, EXT2_SENT, EXT3_SENT, EXT4_SENT, FINISHED, STEP_CHARGE, STEP_REFUND, STEP_TRANSFER,
)
from app.problems import DUPLICATE_PAYMENT, KEY_TABLE_UNAVAILABLE, ProblemError
from app.rails.answers import Charge, Refund, Transfer

ENDPOINT = "POST /v1/payments"
# Every final outcome, good or bad, is a payment resource that now exists, so
# it is answered 201 Created; its `status` says how it ended.
FINAL_STATUS_CODE = 201
# A stored response is replayed byte for byte, so it is kept whole, never
# truncated; and the key table must not become a store of blobs. A payment's
# response is well under 2 KiB even with every field at its longest
# (tests/unit/test_stored_response_cap.py); a larger one is a bug, refused
# before it is stored. The database refuses it too (migration 0005).
MAX_STORED_RESPONSE_BYTES = 4096
# A missing partition is not fixed in a second: someone must run the upkeep.
KEY_TABLE_RETRY_AFTER_SECONDS = 30


def new_payment_id() -> uuid.UUID:
    """A time-ordered id (UUIDv7): new payments land at the right-hand edge of the
    primary key's index instead of on a random page of it, which keeps the index
    compact and writes fewer pages, and less WAL, per payment
    (docs/reference/performance.md has the measurement)."""
    return uuid7()


class StoredResponseTooLarge(Exception):
    """A bug: a final response over MAX_STORED_RESPONSE_BYTES. Nothing is stored; the payment is not finished."""


@dataclass(frozen=True)
class Operation:
    """One payment request as its owner sees it between phases."""

    lease: Lease
    recovery_point: str
    payment: Payment
    # True when an earlier attempt may already have made this point's external
    # call (we took the operation over from a dead owner, or from one that
    # released it after an unknown outcome): the runner probes before it sends.
    # False for a fresh intent, and after a release that said the call was
    # certainly not sent (a refused connection).
    resumed: bool
    # Which attempt this is (1 for the first owner, +1 per takeover).
    attempt: int = 1
    response: tuple[int, str] | None = None


async def handler1(
    conn: AsyncConnection,
    *,
    client_id: int,
    key: str,
    request_hash: bytes,
    request: PaymentRequest,
    lease_seconds: float,
) -> Operation | None:
    """Claim the key and create the payment; None if the key already exists.

    Durable after commit: the key row (started, EXT1_SENT, our lease) and the
    payment row (processing, with its fee and the charge's derived key K1).
    Crash before commit: nothing of this request exists; a retry starts afresh.
    Crash after commit: the row says EXT1_SENT, so a resumer probes the PSP by
    K1 and charges (with K1) only if the PSP has never seen it.
    Running it again is safe: the INSERT of the key conflicts and returns no
    row, and the caller reads the stored row instead.
    """
    fee = fee_for(request.amount)
    try:
        row = (
            await conn.execute(
                sql.HANDLER1,
                dict(
                    client_id=client_id, key=key, endpoint=ENDPOINT, request_hash=request_hash,
                    recovery_point=EXT1_SENT, payment_id=new_payment_id(), lease_seconds=lease_seconds,
                    reference=request.reference, amount=request.amount, currency=request.currency,
                    fee=fee, net=request.amount - fee, card_token=request.card_token,
                    beneficiary_name=request.beneficiary.name, beneficiary_iban=request.beneficiary.iban,
                    psp_charge_key=derived_key(client_id, key, STEP_CHARGE),
                ),
            )
        ).mappings().one_or_none()
    except IntegrityError as exc:
        if "no partition of relation" in str(exc.orig):
            # Today's partition of the key table is missing: its upkeep has
            # not run for a week. Nothing was written; say so, never a 500.
            raise ProblemError(
                KEY_TABLE_UNAVAILABLE, "the key table has no partition for today; retry later with the same key",
                headers={"Retry-After": str(KEY_TABLE_RETRY_AFTER_SECONDS)},
            ) from None
        if "idempotency_key_payment_id_fkey" not in str(exc.orig):
            raise
        # The reference is taken: the statement, claim included, was rolled
        # back (see sql.HANDLER1), so retrying this gives the same answer.
        existing = await payments.id_by_reference(conn, client_id, request.reference)
        raise ProblemError(
            DUPLICATE_PAYMENT,
            f"payment {existing} already has reference {request.reference!r}",
            payment_id=str(existing),
        ) from None
    if row is None:
        return None
    lease = Lease(client_id, key, row["lease_token"])
    payment = Payment(**{k: v for k, v in row.items() if k != "lease_token"})
    return Operation(lease, EXT1_SENT, payment, resumed=False)


async def take_over(conn: AsyncConnection, client_id: int, key: str, lease_seconds: float) -> Operation | None:
    """Become the owner of a started operation whose lease has run out.

    Durable after commit: a new lease token and attempt count; the recovery
    point is unchanged, so no completed phase is re-run. The previous owner,
    if it is merely slow rather than dead, is fenced off from then on.
    None means someone else holds a live lease (or just took it over).
    """
    taken = await keys.take_over(conn, client_id, key, lease_seconds, event="taken over")
    if taken is None:
        return None
    lease, not_sent = taken
    row = await keys.load(conn, client_id, key)
    assert row is not None and row.payment_id is not None
    payment = await payments.get(conn, client_id, row.payment_id)
    assert payment is not None
    return Operation(lease, row.recovery_point, payment, resumed=not not_sent, attempt=row.attempts)


async def record_charge(conn: AsyncConnection, op: Operation, charge: Charge, lease_seconds: float) -> Operation:
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
        declined = replace(op.payment, status="declined", psp_charge_id=charge.id, decline_code=charge.decline_code)
        return await _finish(conn, op, sql.CHARGE_DECLINED, declined, event="charge declined",
                             charge_id=charge.id, decline_code=charge.decline_code)
    payment = await _fenced(
        conn, sql.CHARGE_CAPTURED, op,
        recovery_point=EXT2_SENT, lease_seconds=lease_seconds, event="charge succeeded",
        charge_id=charge.id,
        e2e=end_to_end_reference(client_id, key),
        transfer_key=derived_key(client_id, key, STEP_TRANSFER),
        **postings.legs("charge_captured", postings.charge_captured(op.payment)),
    )
    return replace(op, recovery_point=EXT2_SENT, payment=payment, resumed=False)


async def record_transfer(conn: AsyncConnection, op: Operation, transfer: Transfer, lease_seconds: float) -> Operation:
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
        paid = replace(op.payment, status="succeeded", rail_transfer_id=transfer.id)
        return await _finish(
            conn, op, sql.PAYOUT_SENT, paid, event="transfer accepted", transfer_id=transfer.id,
            **postings.legs("payout_sent", postings.payout_sent(op.payment)),
        )
    # "rejected", the rail's only other documented final status: it will
    # never pay this out, so the charge is refunded.
    payment = await _fenced(
        conn, sql.PAYOUT_REJECTED, op,
        recovery_point=EXT3_SENT, lease_seconds=lease_seconds, event="transfer rejected",
        transfer_id=transfer.id,
        reject_reason=transfer.reject_reason,
        refund_key=derived_key(op.lease.client_id, op.lease.key, STEP_REFUND),
    )
    return replace(op, recovery_point=EXT3_SENT, payment=payment, resumed=False)


async def record_refund(conn: AsyncConnection, op: Operation, refund: Refund, lease_seconds: float) -> Operation:
    """The compensating refund's outcome: the payment ends failed, money returned.

    Durable after commit: the refund id, the ledger's `charge_refunded`
    posting (which balances `charge_captured` to zero), status failed and the
    stored response (finished).
    Crash before commit: the row still says EXT3_SENT; the resumer probes the
    PSP by K3, finds this refund and records it then: one refund, never two.
    """
    failed = replace(op.payment, status="failed", psp_refund_id=refund.id)
    return await _finish(
        conn, op, sql.CHARGE_REFUNDED, failed, event="charge refunded", refund_id=refund.id,
        **postings.legs("charge_refunded", postings.charge_refunded(op.payment)),
    )


async def record_return_refund(conn: AsyncConnection, op: Operation, refund: Refund, lease_seconds: float) -> Operation:
    """The refund compensating a returned payout: the payment ends refunded.

    `op` is the compensation's own operation (its key row was written with
    the return, app/payments/returns.py); its payment is the returned one.
    Durable after commit: the refund id, the ledger's `charge_refunded`
    posting (with `payout_returned` before it, the payment's entries sum to
    zero on every account), status refunded, the `payment.refunded` event,
    and the compensation's key row finished. The payment's own key row is
    untouched: a POST replay still answers the response first stored.
    Crash before commit: the row still says EXT4_SENT; the resumer probes
    the PSP by K4, finds this refund and records it then: one refund, never two.
    """
    refunded = replace(op.payment, status="refunded", psp_refund_id=refund.id)
    return await _finish(
        conn, op, sql.RETURN_REFUNDED, refunded, event="charge refunded after the return", refund_id=refund.id,
        **postings.legs("charge_refunded", postings.charge_refunded(op.payment)),
    )


async def release(
    conn: AsyncConnection,
    op: Operation,
    reason: str,
    retry_in: float,
    *,
    event: str = "outcome unknown, released",
    not_sent: bool = False,
) -> None:
    """Give the operation up at its current SENT point: the outcome is not known yet.

    Durable after commit: the same recovery point, no owner, the reason, and
    when the recovery worker may try again; `not_sent` if this attempt
    certainly sent nothing (the next owner may then send without probing).
    A client retry may take over at once; either probes with the same derived
    key (unless not_sent) and carries on. Nothing is reported as failed,
    because nothing is known to have failed.
    """
    await keys.release(conn, op.lease, reason, retry_in, event=event, not_sent=not_sent)


async def park(conn: AsyncConnection, op: Operation, reason: str, recheck_in: float, *, not_sent: bool = False) -> Payment:
    """Stop retrying: the outcome stayed unknown through every attempt allowed.

    Durable after commit: the payment is `indeterminate`, the key row is
    parked at its SENT point with no owner, due for a re-probe in
    `recheck_in` seconds, and the `payment.indeterminate` event (with its
    webhook delivery) is written. Nobody resumes it blindly from here: the worker's
    re-probe (where the external system answers probes) or reconciliation
    against the rail's statements takes it back once it has learned something.
    Crash before commit: nothing changed; once the lease runs out the next
    attempt takes over, probes once more, and parks it if the outcome is
    still unknown.
    """
    await keys.park(conn, op.lease, reason, recheck_in, event="parked", not_sent=not_sent)
    if op.recovery_point == EXT4_SENT:
        # A returned payment's refund: the client was told `payment.returned`
        # and the payment stays so; only the refund waits for the re-probe.
        return op.payment
    payment = await payments.update(conn, "indeterminate", op.payment.id)
    await events.emit(
        conn, client_id=payment.client_id, payment_id=payment.id,
        event_type=events.INDETERMINATE, data=PaymentView.of(payment).body(),
    )
    return payment


async def unpark(conn: AsyncConnection, client_id: int, key: str, lease_seconds: float, *, event: str) -> Operation | None:
    """Take a parked operation back, by someone who has learned something about it.

    Durable after commit: the key row is unparked with a new lease (one more
    attempt, the event on the timeline) and the payment is `processing` again.
    The new owner resumes at the same recovery point, probing first.
    Crash after commit: the lease runs out and the recovery worker resumes it.
    None if it is not parked any more (somebody else took it back first).
    """
    taken = await keys.unpark(conn, client_id, key, lease_seconds, event=event)
    if taken is None:
        return None
    lease, attempt = taken
    row = await keys.load(conn, client_id, key)
    assert row is not None and row.payment_id is not None
    if row.recovery_point == EXT4_SENT:
        payment = await payments.get(conn, client_id, row.payment_id)  # stays returned (see park)
        assert payment is not None
    else:
        payment = await payments.update(conn, "reopened", row.payment_id)
    return Operation(lease, row.recovery_point, payment, resumed=True, attempt=attempt)


async def settle_parked(
    conn: AsyncConnection, client_id: int, key: str, transfer: Transfer, *, lease_seconds: float
) -> Operation | None:
    """Reconciliation settles a parked payout with what the rail's statement says.

    `transfer` is the outcome learned from the statement: accepted (booked),
    or rejected with reason `not_on_statement` (absent from final statements).
    Take the parked operation back, and record the outcome exactly as
    `record_transfer` would have had the rail answered in time. The caller
    runs this in the same transaction as the proof that its reconciliation
    run still owns its window (app/workers/reconciliation.py::_settle).
    Durable after commit: succeeded and finished (booked), or EXT3_SENT with
    the refund's key K3 (absent); the runner then refunds.
    Crash before commit: still parked; the next run settles it.
    Crash after commit: a booked one is done; an absent one waits at
    EXT3_SENT, unparked, where the recovery worker resumes the refund.
    None if the operation is no longer parked (settled by someone else).
    """
    op = await unpark(conn, client_id, key, lease_seconds, event="settled by reconciliation")
    if op is None:
        return None
    return await record_transfer(conn, op, transfer, lease_seconds)


async def _finish(conn: AsyncConnection, op: Operation, statement, final: Payment, *, event: str, **values: Any) -> Operation:
    # The response is built from the payment as it will be after this commit
    # (`final`), and stored by the same statement that makes it so.
    # The event a client must hear about carries the same text, written by
    # the same statement (app/outbox/events.py).
    body = stored_body(final)
    payment = await _fenced(
        conn, statement, op,
        recovery_point=FINISHED, response_code=FINAL_STATUS_CODE, response_body=body, event=event,
        event_type=events.type_for(final.status), **values,
    )
    return replace(op, recovery_point=FINISHED, payment=payment, response=(FINAL_STATUS_CODE, body))


def stored_body(payment: Payment) -> str:
    """The final response's body for `payment`, whole, or StoredResponseTooLarge."""
    body = PaymentView.of(payment).body()
    size = len(body.encode())
    if size > MAX_STORED_RESPONSE_BYTES:
        raise StoredResponseTooLarge(f"a {size}-byte response for payment {payment.id}; the cap is {MAX_STORED_RESPONSE_BYTES}")
    return body


async def _fenced(conn: AsyncConnection, statement, op: Operation, **params: Any) -> Payment:
    """Run a single-statement phase; the payment it left, or LeaseLost if the fence held nothing."""
    lease = op.lease
    row = (
        await conn.execute(statement, dict(client_id=lease.client_id, key=lease.key, token=lease.token, **params))
    ).mappings().one_or_none()
    if row is None:
        raise LeaseLost(f"lease on {lease.key!r} was taken over; this attempt must stop")
    return Payment(**row)
