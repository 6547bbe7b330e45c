"""Reconciliation: settle parked payouts against the rail's statements.

Where it sits: off every request's path. `payments worker` runs
`reconcile_loop`, `payments reconcile --date D` one window. Each run
(`run_window`) claims its UTC day with a durable tick (app/workers/ticks.py),
reads the rail's statements, and settles each parked payout in its own
fenced transaction through app/machine/engine.py::settle_parked: booked
once with our amount, succeeded; absent from every final statement of its
booking horizon, refunded; anything else a break, never auto-corrected.
Return lines go to app/payments/returns.py::record_return, as a backstop to
the rail's notifications. docs/reconciliation.md explains each rule and what
a crash halfway leaves.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

from pydantic import ValidationError
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.db.errors import database_unavailable, describe, loggable
from app.db.transaction import atomic, read
from app.idempotency.key_table import LeaseLost
from app.observability import logs, metrics
from app.machine import engine
from app.machine.crash import reached
from app.machine.declare import FINISHED, Operation
from app.machine.engine import drive, report_finished
from app.payments import returns
from app.payments import payment_table
from app.payments.models import Payment
from app.payments.payment import PAYMENT
from app.payments.recovery_points import EXT2_SENT, EXT4_SENT
from app.rails.answers import ReturnLine, Transfer
from app.rails.outcomes import Unknown
from app.services import Services
from app.workers import pause, ticks
from app.workers.ticks import RunLease

log = logging.getLogger(__name__)

JOB = "reconcile-rail"
ONE_DAY = timedelta(days=1)

_INSERT_BREAK = text(
    """
    INSERT INTO reconciliation_break (window_start, kind, end_to_end_reference, payment_id, details)
    VALUES (:window_start, :kind, :e2e, :payment_id, CAST(:details AS jsonb))
    ON CONFLICT (kind, end_to_end_reference) DO NOTHING
    """
)
_BREAKS = text("SELECT * FROM reconciliation_break ORDER BY detected_at, id")


@dataclass(frozen=True)
class Break:
    kind: str
    end_to_end_reference: str
    payment_id: Any
    details: dict[str, Any]


class StatementUnavailable(Exception):
    """The rail did not give us a statement; the run fails and is retried."""


def yesterday() -> date:
    return datetime.now(UTC).date() - ONE_DAY


async def run_window(services: Services, window: date) -> dict[str, Any] | None:
    """Claim and run the window; its counts, or None if someone else has (or had) it."""
    settings = services.settings
    run = await atomic(services.engine, ticks.claim, JOB, window, settings.reconcile_lease_seconds)
    if run is None:
        return None
    log.info("reconciling %s (attempt %s)", window, run.attempt)
    runs = metrics.worker().reconciliation_runs
    try:
        counts = await _reconcile(services, run)
    except LeaseLost:
        raise  # another run owns the window now; it records the outcome
    except BaseException as exc:
        await atomic(services.engine, ticks.fail, run, repr(exc)[:500])
        runs.labels("statement_unavailable" if isinstance(exc, StatementUnavailable) else "failed").inc()
        raise
    await atomic(services.engine, ticks.finish, run, counts)
    runs.labels("finished").inc()
    log.info("reconciled %s: %s", window, counts)
    return counts


async def _reconcile(services: Services, run: RunLease) -> dict[str, Any]:
    window = run.window_start
    settings = services.settings
    lease_seconds = settings.reconcile_lease_seconds
    horizon = settings.reconcile_booking_days
    # Payouts instructed up to `horizon` days before may be booked on this
    # window's statement, so they are candidates too; each is decided only
    # from the statements of its own booking horizon.
    parked = await read(services.engine, payment_table.parked_payouts, window - horizon * ONE_DAY, window)
    days = {window} | {d for p, _ in parked for d in _booking_days(p, horizon)}
    statements = {day: await _statement(services, day) for day in sorted(days)}

    booked: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for statement in statements.values():
        for entry in statement["entries"]:
            booked[entry["end_to_end_reference"]].append(entry)
    ours = await read(services.engine, payment_table.by_end_to_end, list(booked))
    breaks = [b for ref, entries in booked.items() if (b := _break_for(ref, entries, ours.get(ref)))]
    if breaks:
        recorded = await atomic(services.engine, _record_breaks, run, breaks, lease_seconds)
        for b in recorded:
            metrics.worker().reconciliation_breaks.labels(b.kind).inc()
            log.error("reconciliation break %s: %s, payment %s", b.kind, b.end_to_end_reference, b.payment_id or "(none of ours)")

    counts: Counter[str] = Counter(entries=sum(len(e) for e in booked.values()), breaks=len(breaks))
    broken = {b.end_to_end_reference for b in breaks}
    for payment, key in parked:
        # One task, many payments: each one's log fields end with it.
        with logs.payment_scope():
            logs.bind(client_id=payment.client_id, key_hash=logs.key_hash(key), payment_id=str(payment.id))
            await _settle_one(services, run, payment, key, booked.get(payment.end_to_end_reference, []),
                              broken, statements, counts)
    for line in statements[window].get("returns", []):
        try:
            parsed = ReturnLine.model_validate(line)
        except ValidationError as exc:
            # Not guessed at (an unknown reason code, say): left for a person.
            # Its ids only: a line we cannot read may carry anything (a name, an IBAN).
            log.error("return line refused, not one the rail documents: return %s of %s (%s)",
                      *((line.get("return_id"), line.get("end_to_end_reference")) if isinstance(line, dict)
                        else ("?", "?")), exc.errors()[0]["msg"])
            counts["return_lines_refused"] += 1
            continue
        counts[await _return_line(services, run, parsed)] += 1
    return dict(counts)


async def _settle_one(
    services: Services, run: RunLease, payment: Payment, key: str, entries: list[dict[str, Any]],
    broken: set[str], statements: dict[date, dict[str, Any]], counts: Counter[str],
) -> None:
    """One parked payout: settled from the statements, left for a person, or left for a later run."""
    settings = services.settings
    if payment.end_to_end_reference in broken:
        counts["left_for_a_person"] += 1
        return
    if entries:
        outcome = Transfer(id=entries[0]["transfer_id"], status="accepted")
    elif all(statements[d]["final"] for d in _booking_days(payment, settings.reconcile_booking_days)):
        outcome = Transfer(id=None, status="rejected", reject_reason="not_on_statement")
    else:
        counts["not_yet_decidable"] += 1
        return
    op = await atomic(
        services.engine, _settle, run, payment.client_id, key, outcome,
        run_lease_seconds=settings.reconcile_lease_seconds, lease_seconds=settings.lease_seconds,
    )
    if op is None:
        return
    settled = "succeeded" if entries else "refunding"
    counts[f"settled_{settled}"] += 1
    metrics.counter(metrics.UNPARKS, EXT2_SENT, "reconciliation").inc()
    metrics.worker().reconciliation_settled.labels(settled).inc()
    log.info("settled from the rail's statement: %s", settled)
    if op.recovery_point == FINISHED:
        report_finished(op)
    reached(settings.payments_crash_at, "reconcile-after-settlement")
    if not entries:
        # The refund is an ordinary EXT3 step now; if it cannot finish
        # here, the recovery worker will, exactly once, by K3.
        await drive(services, op)


async def _return_line(services: Services, run: RunLease, line: ReturnLine) -> str:
    """A statement's return line, treated as the notification it stands for; the count it adds to."""
    settings = services.settings
    try:
        recorded = await atomic(
            services.engine, _record_return, run, line,
            run_lease_seconds=settings.reconcile_lease_seconds, lease_seconds=settings.lease_seconds,
        )
    except returns.ReturnTooEarly:
        # Our transfer's outcome is not recorded yet (days after the payout,
        # rare): the rail's notification, retried until we accept it, applies it.
        return "returns_not_yet_applicable"
    if recorded.operation is None:
        # Applied with nothing to drive: the client's refunds had taken it all.
        return {"duplicate": "returns_already_notified", "applied": "returns_applied_from_statement"}.get(
            recorded.outcome, "return_breaks")
    reached(settings.payments_crash_at, f"after-commit-{EXT4_SENT}")
    await returns.compensate(services, recorded.operation)
    return "returns_applied_from_statement"


async def _record_return(
    conn: AsyncConnection, run: RunLease, line: ReturnLine, *, run_lease_seconds: float, lease_seconds: float
) -> returns.Recorded:
    await ticks.renew(conn, run, run_lease_seconds)
    return await returns.record_return(
        conn, line, source="statement", message_id=None, body=line.model_dump(),
        lease_seconds=lease_seconds, window=run.window_start,
    )


def _booking_days(payment: Payment, horizon: int) -> list[date]:
    """The statement days that may hold this payout: its instruction day and the horizon after it."""
    assert payment.payout_instructed_at is not None
    instructed = payment.payout_instructed_at.astimezone(UTC).date()
    return [instructed + n * ONE_DAY for n in range(horizon + 1)]


async def _statement(services: Services, day: date) -> dict[str, Any]:
    statement = await services.rail.statement(day)
    if isinstance(statement, Unknown):
        raise StatementUnavailable(statement.reason)
    return statement


def _break_for(ref: str, entries: list[dict[str, Any]], payment: Payment | None) -> Break | None:
    """What, if anything, cannot be settled safely about these bookings of `ref`."""
    if payment is None:
        return Break("unmatched_transfer", ref, None, {"entries": entries})
    if len(entries) > 1:
        return Break("duplicate_booking", ref, payment.id, {"entries": entries})
    [entry] = entries
    if payment.rail_transfer_id is not None and entry["transfer_id"] != payment.rail_transfer_id:
        # Paid out already under another transfer: this is a second booking,
        # perhaps on another day's statement.
        return Break(
            "duplicate_booking", ref, payment.id,
            {"entry": entry, "recorded_transfer_id": payment.rail_transfer_id},
        )
    if payment.status in ("failed", "declined"):
        # We concluded no payout happened (and refunded the charge), yet the
        # rail booked one: money went out twice over. A person must recover it.
        return Break("unexpected_booking", ref, payment.id, {"entry": entry, "payment_status": payment.status})
    if (entry["amount"], entry["currency"]) != (payment.net_minor, payment.currency):
        return Break(
            "amount_mismatch", ref, payment.id,
            {"entry": entry, "expected": {"amount": payment.net_minor, "currency": payment.currency}},
        )
    return None


async def _settle(
    conn: AsyncConnection, run: RunLease, client_id: int, key: str, outcome: Transfer,
    *, run_lease_seconds: float, lease_seconds: float,
) -> Operation | None:
    """One payment settled, in one transaction with the proof that this run still owns its window.

    A run that stalled past its lease and lost the window to another raises
    LeaseLost at `ticks.renew` and changes nothing.
    """
    await ticks.renew(conn, run, run_lease_seconds)
    return await engine.settle_parked(conn, PAYMENT, client_id, key, outcome, lease_seconds=lease_seconds)


async def _record_breaks(conn: AsyncConnection, run: RunLease, breaks: list[Break], lease_seconds: float) -> list[Break]:
    """The breaks recorded now: a break found again by a later run is already there, and not new."""
    await ticks.renew(conn, run, lease_seconds)
    recorded = []
    for b in breaks:
        result = await conn.execute(
            _INSERT_BREAK,
            dict(window_start=run.window_start, kind=b.kind, e2e=b.end_to_end_reference,
                 payment_id=b.payment_id, details=json.dumps(b.details, default=str)),
        )
        if result.rowcount == 1:
            recorded.append(b)
    return recorded


async def list_breaks(conn: AsyncConnection) -> list[dict[str, Any]]:
    return [dict(r) for r in (await conn.execute(_BREAKS)).mappings().all()]


async def reconcile_loop(services: Services, stop: asyncio.Event) -> None:
    """Inside `payments worker`: keep trying to claim the recent closed windows.

    Every closed day of the booking horizon up to yesterday, oldest first, so
    a day on which no worker ran is still reconciled later. Most tries find
    the window finished (or held by another worker) and cost one INSERT that
    conflicts. A failed run is retried on the next try.
    """
    while not stop.is_set():
        last = yesterday()
        for back in range(services.settings.reconcile_booking_days, -1, -1):
            try:
                await run_window(services, last - back * ONE_DAY)
            except (StatementUnavailable, LeaseLost) as exc:
                log.warning("reconciliation did not complete: %s", exc)
            except Exception as exc:
                if database_unavailable(exc):
                    # One line, no SQL; and the other windows would fail the
                    # same way, so this round ends here and the next one, a
                    # full `reconcile_every_seconds` later, retries them all.
                    log.warning("reconciliation paused, the database is unavailable (%s)", describe(exc))
                    break
                log.error("reconciliation failed; the window will be retried\n%s", loggable(exc))
        await pause(stop, services.settings.reconcile_every_seconds)
