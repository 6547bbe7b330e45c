"""The refund's phases, each beside its statement: the reservation, and the PSP's answer recorded.

The machine that orders them is app/payments/refunds/refund.py; read it
first. As for the payment (app/payments/phases.py), each phase is one
statement built by app/machine/statements.py from the fence, the phase's own
writes and the outbox, except the start, which is a transaction because it
may have to undo itself:

    claim_refund    claim the key, reserve the amount on the payment,
                    create the refund                       -> EXT5_SENT
                    (or: nothing left to reserve, refused   -> finished, the refusal stored)
    record_outcome  the PSP's final answer: succeeded (ledger) or
                    failed (the reservation given back)     -> finished

The reservation is the one rule that keeps refunds within the charge, under
any concurrency: a conditional write on the payment's refunded amount, made
under the payment's row lock, that only succeeds if what is left covers the
refund. Of fifty refunds racing for the same payment, each waits for the
lock in turn and sees what the ones before it took; the database's CHECK
(migration 0011) refuses anything that would slip past it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection
from uuid6 import uuid7

from app.idempotency.key_table import KeyRow, Lease
from app.idempotency.keys import derived_key
from app.ledger import postings
from app.machine import engine
from app.machine.declare import FINISHED, Machine, Operation
from app.machine.statements import claim, finish, refusal
from app.outbox import events
from app.payments.recovery_points import EXT5_SENT, STEP_CLIENT_REFUND
from app.payments.refunds.models import Refund, RefundRequest, RefundView
from app.problems import (
    DUPLICATE_REFUND, PAYMENT_NOT_REFUNDABLE, REFUND_EXCEEDS_PAYMENT, ProblemError,
)
from app.rails.answers import ClientRefund

# A refund that reached its end (succeeded or failed) is a resource that now
# exists: 201, its `status` says how it ended. A refusal stored under the key
# is answered with its own status (409).
FINAL_STATUS_CODE = 201


def psp_refund_key(client_id: int, key: str, refund_id: uuid.UUID) -> str:
    """K5: the PSP's idempotency key for this refund, derived from the client's key and the refund.

    Derived, so that every attempt (a retry, the worker, after a crash) sends
    the PSP the same key and the PSP answers a second send as a replay.
    The refund's own id is part of it because a client's key may be used
    again once its row is reaped (KEY_RETENTION_HOURS), for a new refund:
    that one must not be answered with the old refund.
    """
    return derived_key(client_id, key, f"{STEP_CLIENT_REFUND}:{refund_id}")


# --- The start: claim the key, reserve the amount, create the refund -> EXT5_SENT ------------------
#
# `locked` takes the payment's row lock (after the claim, like every phase:
# key row first, payment second) and reads what is left as of the latest
# committed refund; `reserved` takes the amount only if what is left covers
# it (absent: all of it); `created` inserts the refund only if the
# reservation was made, and not if the payment already has a live refund
# with this reference. Whatever did not happen shows as a missing row, and
# `claim_refund` decides from them.
CLAIM_REFUND = claim(
    "SELECT fence.lease_token, fence.stored_on AS key_stored_on, locked.status AS payment_status, locked.remaining,"
    " created.*"
    " FROM fence LEFT JOIN locked ON true LEFT JOIN created ON true",
    locked="""
        SELECT payment.id, payment.status, payment.currency, payment.psp_charge_id,
               payment.amount_minor - payment.refunded_minor AS remaining
          FROM fence                                   -- only under a claim we won
          JOIN payment ON payment.id = :payment_id AND payment.client_id = :client_id
           FOR UPDATE OF payment
    """,
    reserved="""
        UPDATE payment
           SET refunded_minor = payment.refunded_minor + coalesce(CAST(:amount AS bigint), locked.remaining),
               updated_at = now()
          FROM locked
         WHERE payment.id = locked.id AND locked.status = 'succeeded'
           AND coalesce(CAST(:amount AS bigint), locked.remaining) BETWEEN 1 AND locked.remaining
        RETURNING payment.id, payment.currency, payment.psp_charge_id,
                  coalesce(CAST(:amount AS bigint), locked.remaining) AS amount
    """,
    created="""
        INSERT INTO refund
            (id, payment_id, client_id, idempotency_key, reference, reason, amount_minor, currency, status,
             psp_charge_id, psp_refund_key)
        SELECT :refund_id, reserved.id, :client_id, :key, :reference, :reason, reserved.amount, reserved.currency,
               'pending', reserved.psp_charge_id, :psp_refund_key
          FROM reserved
        ON CONFLICT (payment_id, reference) WHERE status <> 'failed' DO NOTHING
        RETURNING *
    """,
)

# Refused after the claim: the refusal is this key's result, stored and
# replayed like a decline; nothing else was written.
REFUSED = refusal()

_LIVE_BY_REFERENCE = text(
    "SELECT id FROM refund WHERE payment_id = :payment_id AND reference = :reference AND status <> 'failed'"
)


async def claim_refund(
    conn: AsyncConnection, machine: Machine[Refund], *, client_id: int, key: str, request_hash: bytes,
    payment_id: uuid.UUID, request: RefundRequest, lease_seconds: float,
) -> Operation[Refund] | None:
    """Claim the key, reserve the refund's amount on the payment and create the refund; None if the key exists.

    Durable after commit: the key row (started, EXT5_SENT, our lease), the
    payment's refunded amount raised by the refund's, and the refund
    (pending, with its derived key K5). Or, if what is left does not cover
    it: the key row finished with the refusal (409) as its response, and
    nothing else.
    Crash before commit: nothing of this request exists; a retry starts afresh.
    Crash after commit: the row says EXT5_SENT, so a resumer probes the PSP by
    K5 and refunds (with K5) only if the PSP has never seen it.
    A live refund of this payment with the same reference (another key, a
    double click) undoes everything, claim included, and answers 409
    duplicate-refund: nothing is stored, and a retry gets the same answer.
    """
    refund_id = uuid7()
    row = await CLAIM_REFUND.fetch_one(
        conn,
        dict(
            client_id=client_id, key=key, endpoint=machine.endpoint, request_hash=request_hash,
            recovery_point=EXT5_SENT, payment_id=payment_id, lease_seconds=lease_seconds,
            refund_id=refund_id, amount=request.amount, reference=request.reference, reason=request.reason,
            psp_refund_key=psp_refund_key(client_id, key, refund_id),
        ),
    )
    if row is None:
        return None
    lease = Lease(client_id, key, row["lease_token"], row["key_stored_on"])
    if row["id"] is not None:
        refund = Refund(**{k: v for k, v in row.items()
                           if k not in ("lease_token", "key_stored_on", "payment_status", "remaining")})
        return Operation(machine, lease, EXT5_SENT, refund, resumed=False)
    existing = (
        await conn.execute(_LIVE_BY_REFERENCE, dict(payment_id=payment_id, reference=request.reference))
    ).scalar_one_or_none()
    if existing is not None:
        # Raised inside the transaction: the claim and any reservation roll back.
        raise ProblemError(
            DUPLICATE_REFUND, f"refund {existing} of this payment already has reference {request.reference!r}",
            refund_id=str(existing),
        )
    refused = _refusal(payment_id, row["payment_status"], row["remaining"] or 0, request.amount)
    body = json.dumps(refused.body(instance=f"/v1/payments/{payment_id}/refunds"))
    await engine.fenced(
        conn, REFUSED, lease, recovery_point=FINISHED, response_code=refused.problem.status,
        response_body=engine.storable(body), event=f"refused: {refused.problem.slug}",
    )
    return Operation(machine, lease, FINISHED, None, resumed=False,  # type: ignore[arg-type]
                     response=(refused.problem.status, body))


def _refusal(payment_id: uuid.UUID, status: str | None, remaining: int, amount: int | None) -> ProblemError:
    if status != "succeeded":
        return ProblemError(PAYMENT_NOT_REFUNDABLE, f"payment {payment_id} is {status}", payment_status=status)
    wanted = "everything left" if amount is None else f"{amount}"
    return ProblemError(
        REFUND_EXCEEDS_PAYMENT, f"asked to refund {wanted}; {remaining} is left to refund",
        amount_refundable=remaining,
    )


# --- EXT5's outcome: the PSP's final answer -> finished ----------------------------------------------

# The card was refunded: post it. Who funds a refund after the payout went
# out is the client (its receivable, docs/reference/ledger.md); our fee stays ours.
REFUND_SUCCEEDED = finish(
    updated="""
        UPDATE refund
           SET status = 'succeeded', psp_refund_id = :psp_refund_id, updated_at = now(), finished_at = now()
          FROM fence
         WHERE refund.id = :refund_id AND refund.payment_id = fence.payment_id
        RETURNING refund.*
    """,
    posted=postings.posted(payment="updated.payment_id"),
)

# The PSP could not refund: the reservation is given back, exactly once
# (this statement is fenced: a second attempt at it writes nothing).
REFUND_FAILED = finish(
    updated="""
        UPDATE refund
           SET status = 'failed', psp_refund_id = :psp_refund_id, failure_code = :failure_code,
               updated_at = now(), finished_at = now()
          FROM fence
         WHERE refund.id = :refund_id AND refund.payment_id = fence.payment_id
        RETURNING refund.*
    """,
    released="""
        UPDATE payment
           SET refunded_minor = payment.refunded_minor - updated.amount_minor, updated_at = now()
          FROM updated
         WHERE payment.id = updated.payment_id
    """,
)


async def record_outcome(
    conn: AsyncConnection, op: Operation[Refund], answer: ClientRefund, lease_seconds: float
) -> Operation[Refund]:
    """EXT5's outcome: the refund succeeded (posted to the ledger) or failed (its amount refundable again).

    Durable after commit: the refund's final status and the PSP's refund id;
    if it succeeded, the `refund:<id>` posting; if it failed, the payment's
    refunded amount lowered by the refund's; the stored response (201) and
    the `refund.succeeded` or `refund.failed` event, with its webhook.
    Crash before commit: the row still says EXT5_SENT; the resumer's probe by
    K5 finds this same refund at the PSP and records it then: one refund,
    never two, and a failure gives its amount back once.
    """
    refund = op.subject
    if answer.status == "succeeded":
        final = replace(refund, status="succeeded", psp_refund_id=answer.id)
        return await _finish(
            conn, op, REFUND_SUCCEEDED, final, event="refund succeeded", event_type=events.REFUND_SUCCEEDED,
            refund_id=refund.id, psp_refund_id=answer.id,
            **postings.legs(postings.refund_posting(refund.id), postings.refund_succeeded(refund.amount_minor)),
        )
    final = replace(refund, status="failed", psp_refund_id=answer.id, failure_code=answer.failure_code)
    return await _finish(
        conn, op, REFUND_FAILED, final, event="refund failed", event_type=events.REFUND_FAILED,
        refund_id=refund.id, psp_refund_id=answer.id, failure_code=answer.failure_code,
    )


async def _finish(conn: AsyncConnection, op: Operation[Refund], statement, final: Refund, *, event: str,
                  event_type: str, **values: Any) -> Operation[Refund]:
    # The response is the refund as it will be after this commit, stored by
    # the statement that makes it so; its event carries the same text.
    return await engine.finish(
        conn, op, statement, status_code=FINAL_STATUS_CODE, body=RefundView.of(final).body(), event=event,
        event_type=event_type, **values,
    )


# --- The refund as the engine sees it ----------------------------------------------------------------

# The refund a live key row names: the newest one created under its key
# (an older one with the same key belongs to a reaped key row).
_BY_KEY = text(
    "SELECT * FROM refund WHERE client_id = :client_id AND idempotency_key = :key AND payment_id = :payment_id "
    "ORDER BY id DESC LIMIT 1"
)


async def load(conn: AsyncConnection, row: KeyRow) -> Refund:
    """The refund a key row names (for an owner that takes it over)."""
    found = (
        await conn.execute(_BY_KEY, dict(client_id=row.client_id, key=row.key, payment_id=row.payment_id))
    ).mappings().one()
    return Refund(**found)


async def still_pending(conn: AsyncConnection, op: Operation[Refund]) -> Refund:
    """Parked after the last poll: still `pending`, and the client hears so (`refund.pending`)."""
    refund = op.subject
    await events.emit(
        conn, client_id=refund.client_id, payment_id=refund.payment_id,
        event_type=events.REFUND_PENDING, data=RefundView.of(refund).body(),
    )
    return refund


def log_fields(refund: Refund) -> dict[str, str]:
    return {"payment_id": str(refund.payment_id), "refund_id": str(refund.id)}
