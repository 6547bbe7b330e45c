"""Returned payouts: the rail's message through our inbox, and the refund operation it starts.

This module declares a second operation on the engine (`RETURN_REFUND`):

    start       record_return: the inbox row, the payment returned, the
                ledger, the event, and this operation's own key row  -> EXT4_SENT
    EXT4_SENT   refund the charge with K4    record_return_refund   -> finished (refunded)


Days after a payout was accepted, the beneficiary's bank may send it back
(the account was closed: reason AC04). The rail tells us twice over: it
POSTs a signed notification, at least once (app/api/rail_notifications.py),
and it books a return line on its statement, which reconciliation reads as
the backstop (app/workers/reconciliation.py). Both arrive here, at
`record_return`, with the same inbox key, `return:<the rail's return id>`.

`record_return` is one transaction that does the whole effect together with
the inbox row, so a crash leaves either all of it or none of it:

    rail_message   the inbox row (INSERT ... ON CONFLICT DO NOTHING): if it
                   conflicts, this return was seen before: count the
                   duplicate and drop it; nothing else is written
    payment        succeeded -> returned, with the return's id and reason
    ledger_entry   payout_returned: the money is back, owed to the payer now
    event          payment.returned (the webhook dispatcher reads it from there)
    idempotency_key  the compensation: an operation of its own, claimed by
                   this caller, at EXT4_SENT with the refund's derived key K4

The compensation policy: a returned payout is refunded to the payer's card
in full, our fee included (nobody is at fault that the account closed), and
the payment ends `refunded`. In full means whatever the client's own
refunds (app/payments/refunds/) had not already taken or reserved when the
return is recorded: the payment's row lock orders the return and every
refund, the return reserves all that is left (`return_refund_minor`), and a
refund that comes after it finds the payment returned and nothing left. If
the client's refunds took everything, there is nothing to send the PSP: the
payment is `refunded` at once, in the return's own transaction, with no
compensation to drive. The refund is an ordinary external step driven
by the same engine, from recovery point EXT4_SENT: probe by K4, send with
K4, record (`record_return_refund`). If its owner dies,
its lease runs out and the recovery worker takes it over, like any other
operation. The payment's own key row is never touched: a POST replay of the
original payment answers the response first stored; GET shows `refunded`.

What cannot be applied is decided here, never guessed:

    no payment has this end-to-end reference       unmatched: a break
    declined, failed, returned, refunded already,
    another transfer id, another amount            unexpected: a break
    the transfer's outcome is not recorded yet
    (processing, indeterminate)                    too early: nothing is
                                                   recorded; the caller
                                                   answers 409 and the rail
                                                   delivers it again later

Too early is a refusal rather than a pending inbox row because the rail
retries until it is answered 2xx, and the statement is the backstop should
it ever stop: the message cannot be lost, and nothing here has to remember
to apply it later.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import date
from typing import Any, Literal

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.db.transaction import atomic
from app.idempotency.keys import derived_key
from app.idempotency.key_table import KeyRow, Lease, LeaseLost
from app.ledger import postings
from app.machine import engine
from app.machine.crash import reached
from app.machine.declare import FINISHED, Call, Machine, Operation, Start
from app.machine.engine import Finished, Pending
from app.outbox import events
from app.payments import payment_table, phases
from app.payments.models import Payment, PaymentView
from app.payments.recovery_points import EXT4_SENT, STEP_RETURN_REFUND
from app.problems import RETURN_TOO_EARLY, ProblemError
from app.rails.answers import Refund, ReturnLine
from app.services import Services

log = logging.getLogger(__name__)

# The compensation's key row: under the payment's client, with a key no
# client can send ("@" is outside the Idempotency-Key charset,
# app/idempotency/keys.py), so a client's own key can never collide with it.
COMPENSATION_ENDPOINT = "rail return"

Outcome = Literal["applied", "duplicate", "unmatched", "unexpected", "too_early"]


def inbox_key(return_id: str) -> str:
    """The inbox key of a return: the notification and the statement line both carry the return id."""
    return f"return:{return_id}"


def compensation_key(return_id: str) -> str:
    return f"@return:{return_id}"


@dataclass(frozen=True)
class Recorded:
    """What became of one message: its outcome and, where it was applied, the compensation to drive."""

    outcome: Outcome
    payment: Payment | None = None
    # The compensation, owned by the caller (applied); or, for a duplicate
    # of an applied return, where to find it (client id, key) to resume it.
    operation: Operation | None = None
    compensation: tuple[int, str] | None = None
    detail: str = ""


_LOCK_PAYMENT = text("SELECT * FROM payment WHERE end_to_end_reference = :e2e FOR UPDATE")

_INBOX = text(
    """
    INSERT INTO rail_message
        (inbox_key, source, message_id, return_id, end_to_end_reference, reason_code, outcome, payment_id, body)
    VALUES (:inbox_key, :source, :message_id, :return_id, :e2e, :reason_code, :outcome, :payment_id,
            CAST(:body AS jsonb))
    ON CONFLICT (inbox_key) DO NOTHING
    RETURNING inbox_key
    """
)

_DUPLICATE = text(
    """
    UPDATE rail_message SET duplicates = duplicates + 1, last_duplicate_at = now()
     WHERE inbox_key = :inbox_key
    RETURNING outcome, payment_id, return_id
    """
)

# The return takes what is left of the charge for its compensation: SET
# sees the row as it was, so `return_refund_minor` is what the client's
# refunds had not taken, and nothing is refundable afterwards.
_RETURNED = text(
    """
    UPDATE payment
       SET status = 'returned', return_id = :return_id, return_reason = :reason_code, returned_at = now(),
           psp_refund_key = :refund_key, return_refund_minor = amount_minor - refunded_minor,
           refunded_minor = amount_minor, updated_at = now()
     WHERE id = :id AND status = 'succeeded'
    RETURNING *
    """
)

# Nothing left to refund (the client's refunds took it all): refunded at once.
_REFUNDED_ALREADY = text(
    "UPDATE payment SET status = 'refunded', updated_at = now() WHERE id = :id AND status = 'returned' RETURNING *"
)

_POSTED = text(
    """
    INSERT INTO ledger_entry (payment_id, posting, account, debit_minor, credit_minor, currency)
    SELECT :payment_id, CAST(:posting AS text), leg.account, leg.debit, leg.credit, :currency
      FROM unnest(CAST(:accounts AS text[]), CAST(:debits AS bigint[]), CAST(:credits AS bigint[]))
             AS leg(account, debit, credit)
    """
)

# The compensation is claimed by whoever recorded the return (a lease, as
# handler1's claim), so it is driven at once; if that owner dies, the lease
# runs out and the recovery worker takes it over.
_COMPENSATION = text(
    """
    INSERT INTO idempotency_key
        (client_id, key, endpoint, request_hash, state, recovery_point, payment_id,
         lease_token, lease_expires_at, timeline)
    VALUES (:client_id, :key, :endpoint, :request_hash, 'started', :recovery_point,
            :payment_id, gen_random_uuid(),
            now() + make_interval(secs => :lease_seconds),
            jsonb_build_array(jsonb_build_object(
                'at', now(), 'event', CAST(:event AS text),
                'recovery_point', CAST(:recovery_point AS text), 'attempt', 1)))
    -- No ON CONFLICT, and no claim_idempotency_key: this key is new by
    -- construction. It is written only in the transaction that inserts the
    -- return's inbox row (rail_message, unique per return): a second writer
    -- of the same return waits on that row, finds it, and never gets here;
    -- and no client can send a key starting with '@'. (A conflict here
    -- would be a bug, and is raised.)
    RETURNING lease_token, stored_on
    """
)

_BREAK = text(
    """
    INSERT INTO reconciliation_break (window_start, kind, end_to_end_reference, payment_id, details)
    VALUES (coalesce(CAST(:window_start AS date), CAST(timezone('UTC', now()) AS date)),
            :kind, :e2e, :payment_id, CAST(:details AS jsonb))
    ON CONFLICT (kind, end_to_end_reference) DO NOTHING
    """
)


class ReturnTooEarly(Exception):
    """The payment's transfer outcome is not recorded yet: nothing was written; deliver it again later."""


def _decide(payment: Payment | None, line: ReturnLine) -> tuple[Outcome, str]:
    if payment is None:
        return "unmatched", "no payment has this end-to-end reference"
    if payment.status in ("processing", "indeterminate"):
        return "too_early", f"payment {payment.id} is {payment.status}: its transfer's outcome is not recorded yet"
    if payment.status != "succeeded":
        return "unexpected", f"payment {payment.id} is {payment.status}, not a payout that can be returned"
    if line.transfer_id != payment.rail_transfer_id:
        return "unexpected", f"transfer {line.transfer_id} is not payment {payment.id}'s ({payment.rail_transfer_id})"
    if (line.amount, line.currency) != (payment.net_minor, payment.currency):
        return "unexpected", (
            f"returned {line.amount} {line.currency}, paid out {payment.net_minor} {payment.currency}"
        )
    return "applied", ""


async def record_return(
    conn: AsyncConnection,
    line: ReturnLine,
    *,
    source: Literal["notification", "statement"],
    message_id: str | None,
    body: dict[str, Any],
    lease_seconds: float,
    window: date | None = None,
) -> Recorded:
    """The start phase: the inbox row and the return's whole effect, in the caller's transaction (`atomic`).

    Durable after commit (applied): the inbox row, the payment `returned`,
    the `payout_returned` posting, the `payment.returned` event and the
    compensation's key row at EXT4_SENT, leased to the caller. (Unmatched or
    unexpected: the inbox row and a reconciliation break.)
    Crash before commit: nothing of it; the rail delivers the notification
    again (or reconciliation reads the return line), and it is applied then.
    Crash after commit: every later delivery is a duplicate, dropped; the
    compensation's lease runs out and the recovery worker drives the refund.
    Running it again is safe: the inbox INSERT conflicts and nothing else is
    written. Raises ReturnTooEarly (nothing written) when the transfer's
    outcome is not recorded yet.
    """
    key = inbox_key(line.return_id)
    # The payment row is locked first, so that two deliveries of one return
    # (or a delivery and the statement) queue here, and a phase recording
    # the transfer's outcome at this moment commits before we read it.
    row = (await conn.execute(_LOCK_PAYMENT, dict(e2e=line.end_to_end_reference))).mappings().one_or_none()
    payment = None if row is None else Payment(**row)
    outcome, detail = _decide(payment, line)
    if outcome == "too_early":
        # Before the inbox insert: a duplicate is never too early (an
        # applied return left the payment returned, not processing).
        raise ReturnTooEarly(detail)
    inserted = (
        await conn.execute(
            _INBOX,
            dict(inbox_key=key, source=source, message_id=message_id, return_id=line.return_id,
                 e2e=line.end_to_end_reference, reason_code=line.reason_code, outcome=outcome,
                 payment_id=None if outcome == "unmatched" or payment is None else payment.id,
                 body=json.dumps(body)),
        )
    ).one_or_none()
    if inserted is None:
        seen = (await conn.execute(_DUPLICATE, dict(inbox_key=key))).mappings().one()
        compensation = None
        if seen["outcome"] == "applied" and payment is not None:
            compensation = (payment.client_id, compensation_key(seen["return_id"]))
        return Recorded("duplicate", payment, compensation=compensation, detail=f"{key} was recorded before")
    if outcome != "applied":
        await conn.execute(
            _BREAK,
            dict(window_start=window, kind=f"{outcome}_return", e2e=line.end_to_end_reference,
                 payment_id=None if payment is None else payment.id,
                 details=json.dumps({"source": source, "message_id": message_id, "return": line.model_dump(),
                                     "why": detail})),
        )
        log.warning("return %s of %s: %s (%s), recorded as a break", line.return_id, line.end_to_end_reference,
                    outcome, detail)
        return Recorded(outcome, payment, detail=detail)
    assert payment is not None
    applied = await _apply(conn, payment, line, lease_seconds)
    if isinstance(applied, Payment):  # nothing left to refund: no compensation to drive
        return Recorded("applied", applied)
    return Recorded("applied", applied.subject, operation=applied)


async def _apply(
    conn: AsyncConnection, payment: Payment, line: ReturnLine, lease_seconds: float
) -> Operation[Payment] | Payment:
    comp_key = compensation_key(line.return_id)
    refund_key = derived_key(payment.client_id, comp_key, STEP_RETURN_REFUND)
    row = (
        await conn.execute(
            _RETURNED,
            dict(id=payment.id, return_id=line.return_id, reason_code=line.reason_code, refund_key=refund_key),
        )
    ).mappings().one()
    returned = Payment(**row)
    await _posted_and_told(conn, returned, "payout_returned", postings.payout_returned(returned), events.RETURNED)
    if returned.return_refund_minor == 0:
        return await _refunded_already(conn, returned)
    claimed = (
        await conn.execute(
            _COMPENSATION,
            dict(client_id=returned.client_id, key=comp_key, endpoint=COMPENSATION_ENDPOINT,
                 request_hash=hashlib.sha256(inbox_key(line.return_id).encode()).digest(),
                 recovery_point=EXT4_SENT, payment_id=returned.id, lease_seconds=lease_seconds,
                 event=f"returned by the rail ({line.reason_code})"),
        )
    ).one()
    lease = Lease(returned.client_id, comp_key, claimed.lease_token, claimed.stored_on)
    return Operation(RETURN_REFUND, lease, EXT4_SENT, returned, resumed=False)


async def _refunded_already(conn: AsyncConnection, returned: Payment) -> Payment:
    """The client's refunds took the whole charge: no compensation to send; the payment ends `refunded` now."""
    row = (await conn.execute(_REFUNDED_ALREADY, dict(id=returned.id))).mappings().one()
    refunded = Payment(**row)
    await _posted_and_told(conn, refunded, "charge_refunded", postings.charge_refunded(refunded), events.REFUNDED)
    return refunded


async def _posted_and_told(
    conn: AsyncConnection, payment: Payment, posting: str, entries: list[tuple[str, int, int]], event_type: str
) -> None:
    """A change of the payment's status in the return's transaction: its posting, and the event the client hears."""
    await conn.execute(
        _POSTED, dict(payment_id=payment.id, currency=payment.currency, **postings.legs(posting, entries)),
    )
    await events.emit(
        conn, client_id=payment.client_id, payment_id=payment.id, event_type=event_type,
        data=PaymentView.of(payment).body(),
    )


# --- EXT4's outcome: the card refunded -> finished (refunded) ---------------------------------------
#
# The same statement as the refund of a rejected payout (phases.CHARGE_REFUNDED),
# ending the payment `refunded`. Its fence is the compensation's own key row,
# whose payment_id is the returned payment.


async def record_return_refund(
    conn: AsyncConnection, op: Operation[Payment], refund: Refund, lease_seconds: float
) -> Operation[Payment]:
    """The refund compensating a returned payout: the payment ends refunded.

    Durable after commit: the refund id, the ledger's `charge_refunded`
    posting (with `payout_returned` before it, the payment's entries sum to
    zero on every account), status refunded, the `payment.refunded` event,
    and the compensation's key row finished. The payment's own key row is
    untouched: a POST replay still answers the response first stored.
    Crash before commit: the row still says EXT4_SENT; the resumer probes
    the PSP by K4, finds this refund and records it then: one refund, never two.
    """
    refunded = replace(op.subject, status="refunded", psp_refund_id=refund.id)
    return await engine.finish(
        conn, op, phases.CHARGE_REFUNDED, status_code=phases.FINAL_STATUS_CODE, body=PaymentView.of(refunded).body(),
        event="charge refunded after the return", event_type=events.REFUNDED, status=refunded.status,
        refund_id=refund.id,
        **postings.legs("charge_refunded", postings.charge_refunded(op.subject)),
    )


async def _load(conn: AsyncConnection, row: KeyRow) -> Payment:
    assert row.payment_id is not None
    payment = await payment_table.get(conn, row.client_id, row.payment_id)
    assert payment is not None
    return payment


# --- The machine --------------------------------------------------------------------------------------
#
# Parked, the payment stays `returned` (the client was told `payment.returned`);
# only the refund waits for the worker's re-probe.
RETURN_REFUND: Machine[Payment] = Machine(
    name="return refund",
    endpoint=COMPENSATION_ENDPOINT,
    start=Start(record_return, "record the return through the inbox, and claim the refund", leads_to=EXT4_SENT),
    calls={
        EXT4_SENT: Call(
            "EXT4", "refund the returned payment's charge at the PSP with K4",
            send=lambda s, p: s.psp.refund(p.psp_refund_key, p, amount=p.return_refund_minor),
            probe=lambda s, p: s.psp.find_refund(p.psp_refund_key),
            record=record_return_refund, leads_to=(FINISHED,),
        ),
    },
    load=_load,
    log_fields=lambda payment: {"payment_id": str(payment.id)},
)


# --- What the rail's notification and reconciliation call -----------------------------------------------


async def receive_notification(
    services: Services, line: ReturnLine, *, message_id: str, body: Mapping[str, Any]
) -> Recorded:
    """A verified notification of a return, recorded through the inbox; 409 return-too-early if it is.

    The caller answers the rail only after this commits, then runs
    `follow_up` once the answer is sent, so the rail never waits on the PSP.
    """
    settings = services.settings
    try:
        recorded = await atomic(
            services.engine, record_return, line, source="notification", message_id=message_id,
            body=dict(body), lease_seconds=settings.lease_seconds,
        )
    except ReturnTooEarly as exc:
        raise ProblemError(
            RETURN_TOO_EARLY, str(exc), headers={"Retry-After": str(settings.retry_after_seconds)}
        ) from None
    if recorded.operation is not None:
        # Recorded, not yet acknowledged: the gap the rail's redelivery covers.
        reached(settings.payments_crash_at, f"after-commit-{EXT4_SENT}")
    return recorded


async def follow_up(services: Services, recorded: Recorded) -> None:
    """After the rail is answered: drive the refund this return started, or resume a stranded one.

    A redelivery of an applied return is a retry like any other: if the
    refund's owner died, this finishes it (a live owner keeps it). Failures
    are logged; the lease runs out and the recovery worker finishes it.
    """
    try:
        if recorded.operation is not None:
            await compensate(services, recorded.operation)
        elif recorded.compensation is not None:
            await resume(services, *recorded.compensation)
    except Exception:
        log.exception("the refund of a returned payout was interrupted; the recovery worker will finish it")


async def compensate(services: Services, op: Operation[Payment]) -> Finished | Pending | None:
    """Drive the compensation this caller owns; None if it was taken over (its new owner finishes it)."""
    try:
        return await engine.drive(services, op)
    except LeaseLost:
        return None


async def resume(services: Services, client_id: int, key: str) -> Finished | Pending | None:
    """Take over a compensation whose owner is gone and drive it, as a retry would; None if it is not ours to."""
    op = await engine.take_over(services, {COMPENSATION_ENDPOINT: RETURN_REFUND}, client_id, key)
    if op is None:
        return None  # finished, or someone holds a live lease
    return await compensate(services, op)
