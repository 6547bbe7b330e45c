"""The recovery worker: finds operations that nobody is driving, and drives them.

Where it sits: in `payments worker` (app/workers/process.py), beside the
API. It does on a schedule exactly what a client retry does: `sweep_once`
reads the key table's stranded operations (started, no live lease, due),
and `recover` takes each over with the same conditional UPDATE and resumes
it through the same engine; whichever gets there first, the other finds the
row finished or owned. `recheck_parked` re-probes parked ones, and
`observe_backlog` reports what is waiting. docs/request-path.md#the-recovery-worker
explains why several workers and replicas can run at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from app.db.errors import database_unavailable, describe, loggable
from app.db.transaction import read
from app.idempotency import key_table
from app.idempotency.key_table import LeaseLost
from app.observability import logs, metrics
from app.machine.engine import Finished, drive, heal, take_over
from app.payments.machines import BY_ENDPOINT
from app.services import Services
from app.workers import outage_backoff, pause

log = logging.getLogger(__name__)


@dataclass
class SweepCounts:
    """What one sweep found, by what became of each operation."""

    finished: int = 0  # driven to its final response
    pending: int = 0  # outcome still unknown: released with backoff, or parked
    skipped: int = 0  # someone else owned it by the time we tried
    errors: int = 0  # interrupted by a bug or a lost database; still resumable
    healed: int = 0  # parked, and driven on because a re-probe answered

    @property
    def found(self) -> int:
        return self.finished + self.pending + self.skipped + self.errors


async def recover(services: Services, client_id: int, key: str) -> str:
    """Take over one stranded operation and drive it; what became of it."""
    logs.bind(client_id=client_id, key_hash=logs.key_hash(key))
    op = await take_over(services, BY_ENDPOINT, client_id, key)
    if op is None:
        return "skipped"  # a retry or another worker got there first
    try:
        outcome = await drive(services, op)
    except LeaseLost:
        return "skipped"
    except Exception as exc:
        if database_unavailable(exc):
            # One line: SQLAlchemy's text would carry the statement's parameters.
            log.warning("recovering the payment was cut short, the database is unavailable (%s); it stays resumable",
                        describe(exc))
        else:
            log.error("recovering the payment failed; it stays resumable\n%s", loggable(exc))
        return "errors"
    return "finished" if isinstance(outcome, Finished) else "pending"


async def sweep_once(services: Services) -> SweepCounts:
    """One pass: everything stranded right now, driven `worker_concurrency` at a time."""
    settings = services.settings
    stranded = await read(
        services.engine, key_table.stranded,
        min_age=settings.worker_min_age_seconds, limit=settings.worker_concurrency * 4,
    )
    gate = asyncio.Semaphore(settings.worker_concurrency)

    async def one(client_id: int, key: str) -> str:
        async with gate:
            return await recover(services, client_id, key)

    results = await asyncio.gather(*(one(client_id, key) for client_id, key in stranded))
    healed = await recheck_parked(services)
    return SweepCounts(
        **{name: results.count(name) for name in ("finished", "pending", "skipped", "errors")}, healed=healed
    )


async def recheck_parked(services: Services) -> int:
    """Re-probe the parked operations that are due; how many were driven on.

    Each is claimed for this round by one statement (so several workers do
    not all ask), probed, and taken back only if the probe answered
    (`engine.heal`). Most rounds in an outage learn nothing and write nothing
    but the time of the next round.
    """
    settings = services.settings
    due = await read(services.engine, key_table.parked_due, limit=settings.worker_concurrency * 4)
    gate = asyncio.Semaphore(settings.worker_concurrency)

    async def one(client_id: int, key: str) -> bool:
        async with gate:
            try:
                return await heal(services, BY_ENDPOINT, client_id, key) is not None
            except LeaseLost:
                return False
            except Exception as exc:
                log.error("re-probing the parked payment failed; it stays parked\n%s", loggable(exc))
                return False

    return sum(await asyncio.gather(*(one(client_id, key) for client_id, key in due)))


async def recovery_loop(services: Services, stop: asyncio.Event) -> None:
    """Sweep until `stop` is set; in-flight recoveries are cancelled, which releases their leases."""
    settings = services.settings
    failures = 0  # sweeps failed in a row
    observed = 0.0  # when the backlog was last read (monotonic)
    while not stop.is_set():
        sweep = asyncio.create_task(sweep_once(services))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({sweep, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not sweep.done():
            # SIGTERM mid-sweep: cancelling makes the engine give back
            # every lease it holds (see engine.drive) before we exit.
            sweep.cancel()
            await asyncio.gather(sweep, return_exceptions=True)
            return
        stopping.cancel()
        try:
            counts = sweep.result()
        except Exception as exc:
            # A failed read must not end the loop, and with it the worker
            # process: a database restart would stop all recovery.
            metrics.worker().sweeps.labels("failed").inc()
            failures += 1
            wait = outage_backoff(failures, settings.worker_poll_seconds)
            if database_unavailable(exc):
                log.warning("sweep failed, the database is unavailable (%s); next try in %.1f s", describe(exc), wait)
            else:
                log.error("sweep failed; next try in %.1f s\n%s", wait, loggable(exc))
            await pause(stop, wait)
            continue
        failures = 0
        _count(counts)
        if time.monotonic() - observed >= settings.worker_poll_seconds:
            observed = time.monotonic()
            await observe_backlog(services)
        if counts.found or counts.healed:
            log.info("sweep: %s", counts)
        if counts.found < settings.worker_concurrency * 4:
            # Nothing more is waiting: rest until the next poll, or stop.
            await pause(stop, settings.worker_poll_seconds)


def _count(counts: SweepCounts) -> None:
    worker = metrics.worker()
    worker.sweeps.labels("ok").inc()
    worker.last_sweep.set(time.time())
    for result in ("finished", "pending", "skipped", "errors", "healed"):
        if n := getattr(counts, result):
            worker.recoveries.labels(result).inc(n)


async def observe_backlog(services: Services) -> None:
    """The key table's backlog, as gauges; a failed read leaves them as they were (the sweep says why)."""
    try:
        found = await read(services.engine, key_table.backlog, min_age=services.settings.worker_min_age_seconds)
    except Exception as exc:  # noqa: BLE001 - reporting must never stop recovery
        log.debug("backlog not read: %s", describe(exc))
        return
    worker = metrics.worker()
    worker.backlog.set(found.due)
    worker.lag.set(found.oldest_due_seconds)
    worker.unfinished.set(found.unfinished)
    worker.parked.set(found.parked)
