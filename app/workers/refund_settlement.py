"""Settling parked refunds against the PSP's daily settlement report.

Where it sits: off every request's path, beside reconciliation of payouts
(app/workers/reconciliation.py). A client's refund the PSP still had
`pending` after the engine's last poll is parked (app/machine/engine.py),
and the worker's re-probe keeps asking the PSP about it. This is the
backstop for a PSP that settles a refund without its probe saying so (or
whose probe is down): the PSP publishes, per UTC day, every refund that
reached its final status that day. A parked refund found there is settled
through app/machine/engine.py::settle_parked, recorded by the refund's own
record phase exactly as the PSP's answer would have been: a success posted,
a failure's reservation given back once.

A refund missing from every report so far stays parked: absent is not
failed (the PSP may settle it tomorrow), and nothing is guessed.
`payments worker` runs this every RECONCILE_EVERY_SECONDS;
`payments settle-refunds` runs it once. Two runs at once are harmless:
`settle_parked` takes a parked refund back only once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from datetime import UTC, datetime, timedelta

from app.db.errors import database_unavailable, describe, loggable
from app.db.transaction import atomic, read
from app.machine import engine
from app.machine.engine import report_finished
from app.observability import logs
from app.payments.refunds import refund_table
from app.payments.refunds.refund import REFUND
from app.rails.answers import ClientRefund, SettledRefund
from app.rails.gateways import ReportUnavailable
from app.services import Services
from app.workers import pause

log = logging.getLogger(__name__)

ONE_DAY = timedelta(days=1)
# How far back a pass reads the PSP's reports: a refund settles within days
# of being made. One parked for longer than this is left to the worker's
# re-probe and to a person (docs/refunds.md), rather than have every pass
# fetch a report for every day since.
REPORT_DAYS = 14


async def settle_parked_refunds(services: Services) -> dict[str, int]:
    """One pass: every parked refund the PSP's reports show settled, settled; the counts by what became of them."""
    parked = await read(services.engine, refund_table.parked)
    counts: Counter[str] = Counter(parked=len(parked))
    if not parked:
        return dict(counts)
    today = datetime.now(UTC).date()
    first = max(min(refund.created_at.astimezone(UTC).date() for refund, _ in parked),
                today - (REPORT_DAYS - 1) * ONE_DAY)
    settled: dict[str, SettledRefund] = {}
    day = first
    while day <= today:
        report = await services.psp.settlement_report(day)
        settled.update({line.idempotency_key: line for line in report.refunds})
        day += ONE_DAY
    for refund, key in parked:
        line = settled.get(refund.psp_refund_key)
        if line is None:
            counts["still_pending"] += 1
            continue
        with logs.payment_scope():
            logs.bind(client_id=refund.client_id, key_hash=logs.key_hash(key), payment_id=str(refund.payment_id))
            answer = ClientRefund(id=line.refund_id, status=line.status, failure_code=line.failure_code,
                                  amount=line.amount)
            op = await atomic(
                services.engine, engine.settle_parked, REFUND, refund.client_id, key, answer,
                lease_seconds=services.settings.lease_seconds,
            )
            if op is None:
                counts["settled_elsewhere"] += 1
                continue
            report_finished(op)
            counts[f"settled_{line.status}"] += 1
    return dict(counts)


async def settlement_loop(services: Services, stop: asyncio.Event) -> None:
    """Inside `payments worker`: settle parked refunds from the PSP's reports, every RECONCILE_EVERY_SECONDS."""
    while not stop.is_set():
        try:
            counts = await settle_parked_refunds(services)
            if counts.get("parked"):
                log.info("refund settlement: %s", counts)
        except ReportUnavailable as exc:
            log.warning("refund settlement did not complete: %s", exc)
        except Exception as exc:
            if database_unavailable(exc):
                log.warning("refund settlement paused, the database is unavailable (%s)", describe(exc))
            else:
                log.error("refund settlement failed; it runs again later\n%s", loggable(exc))
        await pause(stop, services.settings.reconcile_every_seconds)
