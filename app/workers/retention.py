"""Key retention: keep the key table's partitions ahead of time, and drop the days past retention.

Runs inside `payments worker` once per UTC day (the durable tick
`key-partitions`: with several workers exactly one does the day's upkeep,
and a run that fails or dies is taken over), and on demand as `payments
keys reap [--dry-run]`. Not on a request's path: a claim only needs today's
partition to exist, and `reap` makes sure it does, AHEAD_DAYS ahead; then it
moves the live rows out of each day past KEY_RETENTION_HOURS and drops that
day (app/idempotency/partitions.py). Only key rows are ever removed.
docs/key-table.md#reaping-moving-the-live-rows-out-then-dropping walks one run.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.db.errors import database_unavailable, describe, loggable
from app.db.transaction import atomic, autocommit, maintenance, read
from app.idempotency import partitions
from app.idempotency.partitions import Partition, Plan
from app.idempotency.key_table import LeaseLost
from app.services import Services
from app.workers import pause, ticks
from app.workers.ticks import RunLease

log = logging.getLogger(__name__)

JOB = "key-partitions"
# A run's lease: it renews it before every drop, so this only bounds how long
# a run that died holds the day before another worker takes it over.
RUN_LEASE_SECONDS = 300.0


@dataclass
class Report:
    """What one run did (or, dry, would do)."""

    created: list[str] = field(default_factory=list)
    plans: list[Plan] = field(default_factory=list)
    moved: dict[str, int] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # past retention, but something live is still in it

    def counts(self) -> dict[str, Any]:
        """For scheduled_run.counts."""
        return {
            "partitions_created": len(self.created),
            "partitions_dropped": len(self.dropped),
            "partitions_kept": len(self.kept),
            "rows_moved": sum(self.moved.values()),
            "rows_dropped": sum(p.rows - self.moved.get(p.partition.name, 0) for p in self.plans
                                if p.partition.name in self.dropped),
        }


async def reap(engine: AsyncEngine, retention: timedelta, *, dry_run: bool = False, run: RunLease | None = None) -> Report:
    """One run of the upkeep; with `run`, every drop is fenced by the run's lease."""
    report = Report()
    if dry_run:
        now, today = await read(engine, partitions.clock)
        existing = await read(engine, partitions.list_partitions)
        report.created = [partitions.partition_name(day) for day in partitions.missing_days(existing, today)]
    else:
        report.created = await autocommit(engine, partitions.ensure_ahead)
        now, today = await read(engine, partitions.clock)
        existing = await read(engine, partitions.list_partitions)
    cutoff = now - retention
    for partition in partitions.past_retention(existing, now, retention, today):
        plan = await read(engine, partitions.plan, partition, cutoff)
        report.plans.append(plan)
        if dry_run:
            continue
        if plan.live:
            moved = await autocommit(engine, partitions.move_live_rows, partition, cutoff)
            report.moved[partition.name] = moved
            if moved < plan.live:
                # Held by a live owner (or locked as we passed): dropping now
                # would lose it. Tomorrow's run tries again.
                report.kept.append(partition.name)
                log.info("key partition %s kept: %d live rows held by their owners", partition.name, plan.live - moved)
                continue
        if await maintenance(engine, _drop, partition, cutoff, run):
            report.dropped.append(partition.name)
        else:
            report.kept.append(partition.name)
    return report


async def _drop(conn: AsyncConnection, partition: Partition, cutoff: datetime, run: RunLease | None) -> bool:
    if run is not None:
        # The proof that this run still owns the day, in the drop's own
        # transaction: a run that stalled past its lease drops nothing.
        await ticks.renew(conn, run, RUN_LEASE_SECONDS)
    return await partitions.drop_if_dead(conn, partition, cutoff)


async def run_day(services: Services) -> dict[str, Any] | None:
    """Claim today's upkeep (the database's day) and run it; its counts, or None if someone else has."""
    engine = services.engine
    _, today = await read(engine, partitions.clock)
    run = await atomic(engine, ticks.claim, JOB, today, RUN_LEASE_SECONDS)
    if run is None:
        return None
    retention = timedelta(hours=services.settings.key_retention_hours)
    try:
        report = await reap(engine, retention, run=run)
    except LeaseLost:
        raise  # another worker owns the day now; it records the outcome
    except BaseException as exc:
        await atomic(engine, ticks.fail, run, repr(exc)[:500])
        raise
    counts = report.counts()
    await atomic(engine, ticks.finish, run, counts)
    if report.created or report.dropped or report.kept:
        log.info("key partitions %s: %s", today, counts)
    return counts


async def retention_loop(services: Services, stop: asyncio.Event) -> None:
    """Inside `payments worker`: try to claim today's upkeep every KEY_REAP_EVERY_SECONDS.

    Most tries find the day finished and cost one INSERT that conflicts. A
    failed run (a DROP that gave up waiting for its lock, say) is retried on
    the next try; a database outage is one log line, and the loop carries on.
    """
    while not stop.is_set():
        try:
            await run_day(services)
        except LeaseLost as exc:
            log.warning("key partition upkeep did not complete: %s", exc)
        except Exception as exc:
            if database_unavailable(exc):
                log.warning("key partition upkeep paused, the database is unavailable (%s)", describe(exc))
            else:
                log.error("key partition upkeep failed; it will be retried\n%s", loggable(exc))
        await pause(stop, services.settings.key_reap_every_seconds)
