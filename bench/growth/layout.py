"""The days the growth bench fills, and the daily partitions that hold them.

A database months into production holds the keys of the retention window
(KEY_RETENTION_HOURS back from now), one partition per UTC day, plus the
days the worker creates ahead; the legacy partition that migration 0006 made
of the pre-partitioning table is long gone. A freshly migrated database
instead puts today's keys into that (empty) legacy partition. So both bench
databases, the empty one and the preloaded one, are first given the
production layout: the empty legacy partition dropped, and a partition for
every day of the window. The two then differ only in how many rows they hold.

The partitions are created the way `app/idempotency/partitions.py::ensure_ahead`
creates the coming days' (a table of its own, then ATTACHed), with its names;
only the days differ, since ensure_ahead never creates a past day.

For the drop-vs-DELETE comparison, two more days, older than the window, are
filled identically (reaping.py). The reaper is called with a retention one day
longer than the configured one, so that exactly one of them is past it
(`reap_days`): the project's own reaper drops that day, and the other is
emptied by DELETE for comparison. Nothing else is old enough to be touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import date, datetime, timedelta

import asyncpg

from app.idempotency.partitions import LEGACY, PARENT, partition_name


def parse_sizes(text: str) -> list[int]:
    """"1000000,10000000" -> [1000000, 10000000]: the preloaded sizes, ascending, each measured in turn."""
    try:
        sizes = [int(part.replace("_", "")) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"sizes are whole numbers separated by commas, not {text!r}") from None
    if not sizes or any(n <= 0 for n in sizes):
        raise ValueError(f"sizes must be positive, got {text!r}")
    if sizes != sorted(set(sizes)):
        raise ValueError(f"sizes must grow: the table is only ever added to, got {text!r}")
    return sizes


def retention_days(retention_hours: float) -> int:
    """Whole days that cover the retention window (72 h -> 3)."""
    return math.ceil(retention_hours / 24)


def window_days(now: datetime, retention_hours: float) -> list[date]:
    """The UTC days that keys created within the retention window before `now` fall on, oldest first."""
    first = (now - timedelta(hours=retention_hours)).date()
    return [first + timedelta(days=n) for n in range((now.date() - first).days + 1)]


@dataclass(frozen=True)
class ReapDays:
    """The two identical old days of the drop-vs-DELETE comparison."""

    drop: date  # dropped by the project's reaper
    delete: date  # the same rows DELETEd, for comparison
    reap_retention: timedelta  # what the reaper is called with: `drop` is past it, `delete` is not


def reap_days(today: date, retention_hours: float) -> ReapDays:
    """Two days just older than the window: the newer one stays within `reap_retention`, the older does not.

    With R whole days of retention, the window starts on or after today - R;
    `delete` is today - R - 1 and `drop` today - R - 2. A partition is past a
    retention once its end (the next midnight) is at least that long ago: `drop`
    ends at today - R - 1, which is R + 1 days before today's midnight and so
    more than R + 1 days before now; `delete` ends at today - R, less than
    R + 1 days before any moment of today.
    """
    r = retention_days(retention_hours)
    return ReapDays(today - timedelta(days=r + 2), today - timedelta(days=r + 1), timedelta(days=r + 1))


async def attach_day(conn: asyncpg.Connection, day: date) -> str:
    """The partition of `day`, created and attached if it does not exist yet; its name."""
    name = partition_name(day)
    if await conn.fetchval("SELECT to_regclass($1)", name) is None:
        await conn.execute(f"CREATE TABLE {name} (LIKE {PARENT} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
        await conn.execute(
            f"ALTER TABLE {PARENT} ATTACH PARTITION {name} FOR VALUES FROM ('{day}') TO ('{day + timedelta(days=1)}')"
        )
    return name


async def production_layout(conn: asyncpg.Connection, days: list[date]) -> list[str]:
    """Drop the (empty) legacy partition and attach one partition per day of `days`; the names attached.

    Refuses a database whose legacy partition holds rows: the bench's own
    databases are freshly created, and the rows of any other are not ours to drop.
    """
    if await conn.fetchval("SELECT to_regclass($1)", LEGACY) is not None:
        rows = await conn.fetchval(f"SELECT count(*) FROM {LEGACY}")
        if rows:
            raise RuntimeError(f"{LEGACY} holds {rows} rows: not a fresh bench database")
        await conn.execute(f"DROP TABLE {LEGACY}")
    return [await attach_day(conn, day) for day in days]
