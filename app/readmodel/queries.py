"""The operator console's queries, one SELECT each (run with `app.db.transaction.read`).

Where it sits: under the console's pages (app/console/routes.py), beside
app.payments, above the database; nothing on a payment's path imports it.
The pages run these on `Services.read_model`, which may be a standby a
moment behind (DATABASE_READ_URL), so nothing here may be used to decide
anything, only to show it.
The key table's list is paged by keyset on the time-ordered `payment_id`,
never by OFFSET, and filters are fixed SQL fragments chosen by name, with
values bound as parameters: nothing a reader types becomes SQL text.
docs/console.md#paging-a-big-table explains the keyset.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.outbox.events import AFTER_THE_CURSOR

PAGE_SIZE = 50
# The endpoint a client's payment is claimed under (app/payments/payment.py::PAYMENT,
# not imported: the read model sits beside the payments package, not above it).
PAYMENT_ENDPOINT = "POST /v1/payments"
# ... and the one a client's refund of it is (app/payments/refunds/refund.py::REFUND).
REFUND_ENDPOINT = "POST /v1/payments/{id}/refunds"
STATES = ("started", "finished")


@dataclass(frozen=True)
class Filters:
    """The list's filters; None leaves a column unfiltered."""

    state: str | None = None
    recovery_point: str | None = None
    client_id: int | None = None
    parked: bool | None = None

    def where(self) -> tuple[list[str], dict[str, Any]]:
        clauses: list[str] = []
        params: dict[str, Any] = {}
        if self.state is not None:
            clauses.append("k.state = :state")
            params["state"] = self.state
        if self.recovery_point is not None:
            clauses.append("k.recovery_point = :recovery_point")
            params["recovery_point"] = self.recovery_point
        if self.client_id is not None:
            clauses.append("k.client_id = :client_id")
            params["client_id"] = self.client_id
        if self.parked is True:
            # Spelled as the partial index idempotency_key_parked is defined
            # (only a started row can be parked), so the planner can use it.
            clauses.append("k.state = 'started' AND k.parked_at IS NOT NULL")
        elif self.parked is False:
            clauses.append("k.parked_at IS NULL")
        return clauses, params


@dataclass(frozen=True)
class OperationRow:
    """One key row as the list shows it, with its client's name and its payment's status."""

    client_id: int
    client_name: str
    key: str
    state: str
    recovery_point: str
    payment_id: uuid.UUID
    attempts: int
    lease_live: bool
    lease_expires_at: datetime | None
    parked_at: datetime | None
    last_error: str | None
    created_at: datetime
    updated_at: datetime
    payment_status: str | None
    reference: str | None
    amount_minor: int | None
    currency: str | None

    @property
    def parked_reason(self) -> str | None:
        """Why it is parked: the reason its last attempt recorded (None if not parked)."""
        return (self.last_error or "parked") if self.parked_at is not None else None


@dataclass(frozen=True)
class Page:
    rows: list[OperationRow]
    # The cursor of the next (older) page: the last row's payment id; None on the last page.
    older: uuid.UUID | None


_OPERATION_COLUMNS = """
    k.client_id, c.name AS client_name, k.key, k.state, k.recovery_point, k.payment_id, k.attempts,
    coalesce(k.lease_expires_at > now(), false) AS lease_live, k.lease_expires_at, k.parked_at,
    k.last_error, k.created_at, k.updated_at,
    p.status AS payment_status, p.reference, p.amount_minor, p.currency
"""


async def operations(
    conn: AsyncConnection, filters: Filters, *, before: uuid.UUID | None = None, limit: int = PAGE_SIZE
) -> Page:
    """A page of operations, newest first, older than `before` (a payment id) if given."""
    clauses, params = filters.where()
    clauses.append("k.payment_id IS NOT NULL")
    # A client's payments; a return's compensation (a key row of its own,
    # for the same payment) is shown on its payment's page instead, so each
    # payment id appears once in the keyset order.
    clauses.append(f"k.endpoint = '{PAYMENT_ENDPOINT}'")
    if before is not None:
        clauses.append("k.payment_id < :before")
        params["before"] = before
    # One row more than the page, to know whether an older page exists
    # without counting (a count would read every matching row).
    statement = text(
        f"""
        SELECT {_OPERATION_COLUMNS}
          FROM idempotency_key k
          JOIN client c ON c.id = k.client_id
          LEFT JOIN payment p ON p.id = k.payment_id
         WHERE {" AND ".join(clauses)}
         ORDER BY k.payment_id DESC
         LIMIT :limit
        """
    )
    rows = (await conn.execute(statement, dict(params, limit=limit + 1))).mappings().all()
    page = [OperationRow(**row) for row in rows[:limit]]
    return Page(page, page[-1].payment_id if len(rows) > limit else None)


@dataclass(frozen=True)
class Client:
    id: int
    name: str


async def clients(conn: AsyncConnection) -> list[Client]:
    rows = await conn.execute(text("SELECT id, name FROM client ORDER BY name, id LIMIT 1000"))
    return [Client(r.id, r.name) for r in rows]


@dataclass(frozen=True)
class LedgerEntry:
    posting: str
    account: str
    debit_minor: int
    credit_minor: int
    currency: str
    created_at: datetime


@dataclass(frozen=True)
class Operation:
    """One operation whole: its key row, its payment, its ledger, its breaks."""

    row: OperationRow
    endpoint: str
    next_attempt_at: datetime | None  # None once finished: the worker never tries it again
    response_code: int | None
    finished_at: datetime | None
    timeline: list[dict[str, Any]]
    payment: dict[str, Any]
    ledger: list[LedgerEntry]
    breaks: list[dict[str, Any]] = field(default_factory=list)
    # Operations started for this payment after it finished: the card refund
    # that compensates a payout the rail returned (app/payments/returns.py).
    compensations: list[dict[str, Any]] = field(default_factory=list)
    # The client's refunds of it, oldest first, each with its key row (None
    # once the key is reaped), and the refund requests refused under a key
    # of their own (a stored 409: nothing was reserved, no refund exists).
    refunds: list[dict[str, Any]] = field(default_factory=list)
    refused_refunds: list[dict[str, Any]] = field(default_factory=list)

    @property
    def refunded_minor(self) -> int:
        """Refunded or reserved by a refund in flight: client refunds and a return's compensation alike."""
        return int(self.payment.get("refunded_minor") or 0)

    @property
    def refundable_minor(self) -> int:
        """What a new refund may still take: the rest of the amount, and only of a succeeded payment
        (the same rule the reservation applies, app/payments/refunds/phases.py::CLAIM_REFUND)."""
        if self.payment.get("status") != "succeeded":
            return 0
        return int(self.payment["amount_minor"]) - self.refunded_minor

    @property
    def totals(self) -> dict[str, tuple[int, int]]:
        """(debits, credits) per currency."""
        sums: dict[str, tuple[int, int]] = {}
        for e in self.ledger:
            debit, credit = sums.get(e.currency, (0, 0))
            sums[e.currency] = (debit + e.debit_minor, credit + e.credit_minor)
        return sums

    @property
    def balanced(self) -> bool:
        """Debits equal credits in every currency (an empty ledger balances too)."""
        return all(debit == credit for debit, credit in self.totals.values())


_OPERATION = text(
    f"""
    SELECT {_OPERATION_COLUMNS}, k.endpoint, k.next_attempt_at, k.response_code, k.finished_at, k.timeline,
           -- Not the card token: an operator needs it for nothing. (The IBAN is
           -- read whole, to tell whether its payout goes over a legacy rail; the
           -- pages show it masked.)
           jsonb_build_object(
               'id', p.id, 'reference', p.reference, 'status', p.status,
               'amount_minor', p.amount_minor, 'fee_minor', p.fee_minor, 'net_minor', p.net_minor,
               'currency', p.currency, 'beneficiary_name', p.beneficiary_name,
               'beneficiary_iban', p.beneficiary_iban,
               -- Written with the payment, shown once the payout is instructed (as the API does).
               'end_to_end_reference', CASE WHEN p.payout_instructed_at IS NOT NULL THEN p.end_to_end_reference END,
               'psp_charge_key', p.psp_charge_key, 'psp_charge_id', p.psp_charge_id, 'decline_code', p.decline_code,
               'rail_transfer_key', p.rail_transfer_key, 'rail_transfer_id', p.rail_transfer_id,
               'reject_reason', p.reject_reason, 'psp_refund_key', p.psp_refund_key, 'psp_refund_id', p.psp_refund_id,
               'refunded_minor', p.refunded_minor,
               'payout_instructed_at', p.payout_instructed_at, 'created_at', p.created_at, 'updated_at', p.updated_at
           ) AS payment,
           coalesce((SELECT jsonb_agg(jsonb_build_object(
                        'posting', e.posting, 'account', e.account, 'debit_minor', e.debit_minor,
                        'credit_minor', e.credit_minor, 'currency', e.currency, 'created_at', e.created_at)
                        ORDER BY e.id)
                       FROM ledger_entry e WHERE e.payment_id = p.id), '[]') AS ledger,
           coalesce((SELECT jsonb_agg(to_jsonb(b) ORDER BY b.id)
                       FROM reconciliation_break b WHERE b.payment_id = p.id), '[]') AS breaks,
           coalesce((SELECT jsonb_agg(jsonb_build_object(
                        'key', x.key, 'state', x.state, 'recovery_point', x.recovery_point,
                        'attempts', x.attempts, 'parked', x.parked_at IS NOT NULL, 'last_error', x.last_error,
                        'timeline', x.timeline) ORDER BY x.created_at)
                       FROM idempotency_key x
                      WHERE x.payment_id = p.id
                        AND x.endpoint NOT IN ('{PAYMENT_ENDPOINT}', '{REFUND_ENDPOINT}')), '[]') AS compensations,
           -- A refund's key row is the one its key names, if the refund is the
           -- newest under that key (an older one's row was reaped and the key
           -- used again: app/payments/refunds/phases.py::load reads it the same way).
           coalesce((SELECT jsonb_agg(jsonb_build_object(
                        'id', r.id, 'reference', r.reference, 'reason', r.reason, 'amount_minor', r.amount_minor,
                        'currency', r.currency, 'status', r.status, 'failure_code', r.failure_code,
                        'psp_refund_key', r.psp_refund_key, 'psp_refund_id', r.psp_refund_id,
                        'created_at', r.created_at, 'finished_at', r.finished_at, 'key', x.key,
                        'key_row', CASE WHEN x.key IS NULL THEN NULL ELSE jsonb_build_object(
                            'state', x.state, 'recovery_point', x.recovery_point, 'attempts', x.attempts,
                            'lease_live', coalesce(x.lease_expires_at > now(), false),
                            'parked', x.parked_at IS NOT NULL, 'last_error', x.last_error,
                            'response_code', x.response_code, 'timeline', x.timeline) END)
                        ORDER BY r.id)
                       FROM refund r
                       LEFT JOIN idempotency_key x
                         ON x.client_id = r.client_id AND x.key = r.idempotency_key
                        AND x.endpoint = '{REFUND_ENDPOINT}' AND x.payment_id = r.payment_id
                        AND NOT EXISTS (SELECT 1 FROM refund n WHERE n.client_id = r.client_id
                                           AND n.idempotency_key = r.idempotency_key
                                           AND n.payment_id = r.payment_id AND n.id > r.id)
                      WHERE r.payment_id = p.id), '[]') AS refunds,
           coalesce((SELECT jsonb_agg(jsonb_build_object(
                        'key', x.key, 'response_code', x.response_code, 'created_at', x.created_at,
                        'timeline', x.timeline) ORDER BY x.created_at)
                       FROM idempotency_key x
                      WHERE x.payment_id = p.id AND x.endpoint = '{REFUND_ENDPOINT}'
                        AND NOT EXISTS (SELECT 1 FROM refund n WHERE n.client_id = x.client_id
                                           AND n.idempotency_key = x.key AND n.payment_id = x.payment_id)),
                    '[]') AS refused_refunds
      FROM payment p
      JOIN idempotency_key k ON k.client_id = p.client_id AND k.payment_id = p.id
                            AND k.endpoint = '{PAYMENT_ENDPOINT}'
      JOIN client c ON c.id = k.client_id
     WHERE p.id = :payment_id
    """
)
_OPERATION_FIELDS = {
    "endpoint", "next_attempt_at", "response_code", "finished_at", "timeline", "payment", "ledger", "breaks",
    "compensations", "refunds", "refused_refunds",
}


async def operation(conn: AsyncConnection, payment_id: uuid.UUID) -> Operation | None:
    """The operation of a payment, with everything the console shows of it, in one read."""
    row = (await conn.execute(_OPERATION, dict(payment_id=payment_id))).mappings().one_or_none()
    if row is None:
        return None
    ledger = [
        LedgerEntry(**{**e, "created_at": datetime.fromisoformat(e["created_at"])}) for e in row["ledger"]
    ]
    return Operation(
        row=OperationRow(**{k: v for k, v in row.items() if k not in _OPERATION_FIELDS}),
        endpoint=row["endpoint"],
        next_attempt_at=None if row["state"] == "finished" else row["next_attempt_at"],
        response_code=row["response_code"],
        finished_at=row["finished_at"],
        timeline=row["timeline"],
        payment=row["payment"],
        ledger=ledger,
        breaks=row["breaks"],
        compensations=row["compensations"],
        refunds=row["refunds"],
        refused_refunds=row["refused_refunds"],
    )


@dataclass(frozen=True)
class Backlog:
    """Unfinished operations that are not parked: in flight, or waiting for a retry or the worker."""

    count: int
    due: int  # of which no attempt owns them and their next attempt is due: the worker's work
    oldest_due_at: datetime | None


_PARKED = text(
    f"""
    SELECT {_OPERATION_COLUMNS}
      FROM idempotency_key k
      JOIN client c ON c.id = k.client_id
      LEFT JOIN payment p ON p.id = k.payment_id
     WHERE k.state = 'started' AND k.parked_at IS NOT NULL
     ORDER BY k.parked_at, k.client_id, k.key
     LIMIT :limit
    """
)
# Both read the partial index idempotency_key_unfinished: unfinished, unparked rows only.
_BACKLOG = text(
    """
    SELECT count(*) AS count,
           count(*) FILTER (WHERE next_attempt_at <= now()
                              AND (lease_expires_at IS NULL OR lease_expires_at < now())) AS due,
           min(next_attempt_at) FILTER (WHERE lease_expires_at IS NULL OR lease_expires_at < now()) AS oldest_due_at
      FROM idempotency_key
     WHERE state = 'started' AND parked_at IS NULL
    """
)
_PARKED_COUNT = text("SELECT count(*) FROM idempotency_key WHERE state = 'started' AND parked_at IS NOT NULL")


async def parked(conn: AsyncConnection, *, limit: int = 200) -> tuple[list[OperationRow], int]:
    """Parked operations, longest parked first (at most `limit`), and how many there are in all."""
    rows = (await conn.execute(_PARKED, dict(limit=limit))).mappings().all()
    total = (await conn.execute(_PARKED_COUNT)).scalar_one()
    return [OperationRow(**r) for r in rows], total


async def backlog(conn: AsyncConnection) -> Backlog:
    row = (await conn.execute(_BACKLOG)).one()
    return Backlog(row.count, row.due, row.oldest_due_at)


_RUNS = text(
    """
    SELECT job, window_start, state, attempts, counts, error, started_at, finished_at,
           coalesce(lease_expires_at > now(), false) AS lease_live
      FROM scheduled_run
     ORDER BY window_start DESC, job
     LIMIT :limit
    """
)
_BREAKS = text(
    """
    SELECT b.id, b.window_start, b.kind, b.end_to_end_reference, b.payment_id, b.details, b.detected_at
      FROM reconciliation_break b
     ORDER BY b.detected_at DESC, b.id DESC
     LIMIT :limit
    """
)


async def runs(conn: AsyncConnection, *, limit: int = 60) -> list[dict[str, Any]]:
    """Reconciliation runs (one per job and window), newest window first."""
    return [dict(r) for r in (await conn.execute(_RUNS, dict(limit=limit))).mappings().all()]


async def breaks(conn: AsyncConnection, *, limit: int = 200) -> list[dict[str, Any]]:
    """Reconciliation breaks, newest first: what a person must settle."""
    return [dict(r) for r in (await conn.execute(_BREAKS, dict(limit=limit))).mappings().all()]


# Webhook deliveries, one state at a time. Pending ones soonest due first
# (the partial index `webhook_delivery_due`), the others newest event first
# (the primary key, time-ordered, read backwards): a bounded page either way,
# however many deliveries the table holds.
_DELIVERIES = {
    state: text(
        f"""
        SELECT d.event_id, d.client_id, c.name AS client_name, e.type, e.payment_id, d.state, d.attempts,
               d.next_attempt_at, d.last_status, d.last_error, d.delivered_at, d.created_at,
               coalesce(d.lease_expires_at > now(), false) AS in_flight
          FROM webhook_delivery d
          JOIN event e ON e.id = d.event_id
          JOIN client c ON c.id = d.client_id
         WHERE d.state = '{state}'
         ORDER BY {order}
         LIMIT :limit
        """
    )
    for state, order in (
        ("dead", "d.event_id DESC"),
        ("pending", "d.next_attempt_at, d.event_id"),
        ("delivered", "d.event_id DESC"),
        ("cancelled", "d.event_id DESC"),
    )
}
DELIVERY_STATES = tuple(_DELIVERIES)
# What needs a person (dead) or the dispatcher (pending): counted whole.
# A webhook before its first attempt has no delivery row yet: it is an
# event after the dispatcher's cursor (app/outbox/delivery.py), of a client
# with an endpoint, counted apart as `first`.
_UNDELIVERED = text(
    f"""
    SELECT count(*) FILTER (WHERE state = 'dead') AS dead, count(*) FILTER (WHERE state = 'pending') AS pending,
           count(*) FILTER (WHERE state = 'pending' AND next_attempt_at <= now()
                              AND coalesce(lease_expires_at < now(), true)) AS due,
           (SELECT count(*)
              FROM event e JOIN webhook_endpoint w ON w.client_id = e.client_id
             WHERE {AFTER_THE_CURSOR}
               AND NOT EXISTS (SELECT FROM webhook_delivery d WHERE d.event_id = e.id)) AS first
      FROM webhook_delivery
     WHERE state IN ('dead', 'pending')
    """
)


async def deliveries(conn: AsyncConnection, state: str, *, limit: int = 100) -> list[dict[str, Any]]:
    """Webhook deliveries in `state` (one of DELIVERY_STATES), a bounded page."""
    return [dict(r) for r in (await conn.execute(_DELIVERIES[state], dict(limit=limit))).mappings().all()]


async def undelivered(conn: AsyncConnection) -> dict[str, int]:
    """How many deliveries are dead (for a person), pending, due for the dispatcher now, and waiting for a first attempt."""
    return dict((await conn.execute(_UNDELIVERED)).mappings().one())

# One payment's events, each with its delivery (if its client had an
# endpoint) and every attempt made to deliver it, oldest first. An event
# still after the dispatcher's cursor, of a client with an endpoint, has no
# delivery row yet: it is pending its first attempt.
_PAYMENT_EVENTS = text(
    f"""
    SELECT e.id, e.type, e.created_at,
           coalesce(d.state, CASE WHEN {AFTER_THE_CURSOR}
                                   AND EXISTS (SELECT FROM webhook_endpoint w WHERE w.client_id = e.client_id)
                                  THEN 'pending' END) AS state,
           coalesce(d.attempts, 0) AS attempts, d.last_status, d.last_error, d.delivered_at,
           coalesce((SELECT jsonb_agg(jsonb_build_object(
                        'attempt', a.attempt, 'started_at', a.started_at, 'outcome', a.outcome,
                        'status_code', a.status_code, 'latency_ms', a.latency_ms, 'error_class', a.error_class)
                        ORDER BY a.attempt)
                       FROM webhook_attempt a WHERE a.event_id = e.id), '[]') AS attempt_log
      FROM event e
      LEFT JOIN webhook_delivery d ON d.event_id = e.id
     WHERE e.payment_id = :payment_id
     ORDER BY e.id
    """
)


async def payment_events(conn: AsyncConnection, payment_id: uuid.UUID) -> list[dict[str, Any]]:
    """The events a payment's decisions wrote, with their webhook deliveries and attempts."""
    return [dict(r) for r in (await conn.execute(_PAYMENT_EVENTS, dict(payment_id=payment_id))).mappings().all()]
