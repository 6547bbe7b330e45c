"""Removing a day of keys: the reaper's DROP of its partition vs a DELETE of the same rows.

Two identical old days are preloaded (layout.py::reap_days says which): the
same number of rows, the same mix, a few parked stragglers in each. Then,
each after a CHECKPOINT (so both pay for the full-page images that the first
change to a page after a checkpoint writes, as a reaper would at some point
after one):

drop
    `app/workers/retention.py::reap`, the code the worker's daily tick and
    `payments keys reap` run: it counts the day's rows, moves its live rows
    (the parked stragglers) to today's partition, then drops the partition in
    a transaction of its own. Timed whole, with the WAL it wrote, and its drop
    transaction apart (the targets are about the drop); its report says what
    it moved and dropped.
delete
    `DELETE FROM idempotency_key WHERE stored_on = <day> AND <finished past
    retention>`: the rows a reaper without partitions would delete, and the
    kindest case for it (the partition column in the WHERE confines the
    DELETE to one day's partition; a real one would have to find the rows by
    finished_at across the table). Then VACUUM of that partition, timed apart,
    and the sizes: VACUUM makes the dead rows' space reusable but gives back
    only empty pages at the very end of the file, so the day's heap and
    indexes stay their size, holding a handful of rows.

WAL is read as pg_current_wal_lsn() before and after: the whole server's. On
a server of our own (the embedded one) that is ours alone, give or take
autovacuum; on a shared one others' writes are counted too (the report says
which server it was).

The check that matters for correctness: every live row of the dropped day
(its started keys) is still in the key table afterwards, in today's partition.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from datetime import date, datetime, timedelta
from typing import Any

import asyncpg
from sqlalchemy.ext.asyncio import create_async_engine

from app.config import asyncpg_url
from app.idempotency import partitions
from app.idempotency.partitions import partition_name
from app.workers import retention
from bench.checks import Check


@dataclass
class Sizes:
    """A partition's bytes on disk: its table (heap) and all its indexes."""

    heap: int
    indexes: int

    @property
    def total(self) -> int:
        return self.heap + self.indexes


async def sizes(conn: asyncpg.Connection, name: str) -> Sizes:
    if await conn.fetchval("SELECT to_regclass($1)", name) is None:
        return Sizes(0, 0)
    row = await conn.fetchrow("SELECT pg_table_size($1::regclass) AS heap, pg_indexes_size($1::regclass) AS indexes",
                              name)
    return Sizes(row["heap"], row["indexes"])


async def wal_lsn(conn: asyncpg.Connection) -> str:
    return await conn.fetchval("SELECT pg_current_wal_lsn()::text")


async def wal_between(conn: asyncpg.Connection, start: str, end: str) -> int:
    return int(await conn.fetchval("SELECT pg_wal_lsn_diff(CAST($2::text AS pg_lsn), CAST($1::text AS pg_lsn))",
                                   start, end))


async def wal_since(conn: asyncpg.Connection, lsn: str) -> int:
    return await wal_between(conn, lsn, await wal_lsn(conn))


@dataclass
class Removal:
    """One way of removing a day's keys, measured."""

    how: str
    partition: str
    rows_before: int
    rows_removed: int
    rows_moved: int  # live rows moved out first (the drop only)
    seconds: float
    wal_bytes: int
    before: Sizes
    after: Sizes  # for the DELETE: after its VACUUM
    vacuum_seconds: float | None = None
    vacuum_wal_bytes: int | None = None
    # The drop only: its transaction alone (the lock, the last look for a
    # started row, DROP TABLE, COMMIT), without the plan's count and the move before it.
    drop_seconds: float | None = None
    drop_wal_bytes: int | None = None
    # The drop only: a replay's key lookup through the key table, from
    # another connection, over and over while the drop's transaction ran
    # (seconds each). The drop locks the key table: these say for how long
    # a request on it waited.
    lookups: list[float] = field(default_factory=list)

    def lookup_summary(self) -> dict[str, Any]:
        if not self.lookups:
            return {"count": 0}
        ordered = sorted(self.lookups)
        return {"count": len(ordered), "median_ms": round(ordered[len(ordered) // 2] * 1000, 2),
                "slowest_ms": round(ordered[-1] * 1000, 2)}

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"before": asdict(self.before) | {"total": self.before.total},
                               "after": asdict(self.after) | {"total": self.after.total},
                               "lookups": self.lookup_summary()}


# Between two lookups: about 200 a second, enough to see a wait of a few
# milliseconds without taking a CPU from the drop being measured.
LOOKUP_PACE_SECONDS = 0.005


async def look_up_while(url: str, stop: asyncio.Event, client_id: int, key: str) -> list[float]:
    """Time a replay's lookup of one key (`client_id`, `key`) again and again until `stop`."""
    conn = await asyncpg.connect(url)
    took = []
    try:
        while not stop.is_set():
            started = time.monotonic()
            await conn.fetchval("SELECT state FROM idempotency_key WHERE client_id = $1 AND key = $2", client_id, key)
            took.append(time.monotonic() - started)
            await asyncio.sleep(LOOKUP_PACE_SECONDS)
    finally:
        await conn.close()
    return took


async def _live_keys(conn: asyncpg.Connection, name: str, cutoff: datetime) -> list[tuple[int, str]]:
    rows = await conn.fetch(f"SELECT client_id, key FROM {name} WHERE state = 'started' OR finished_at > $1", cutoff)
    return [(r["client_id"], r["key"]) for r in rows]


async def drop_day(url: str, conn: asyncpg.Connection, day: date, reap_retention: timedelta
                   ) -> tuple[Removal, list[Check]]:
    """The project's reaper, with a retention that makes `day` (and nothing newer) past it."""
    name = partition_name(day)
    now = await conn.fetchval("SELECT key_table_clock()")
    live = await _live_keys(conn, name, now - reap_retention)
    rows = await conn.fetchval(f"SELECT count(*) FROM {name}")
    before = await sizes(conn, name)
    await conn.execute("CHECKPOINT")
    engine = create_async_engine(asyncpg_url(url), hide_parameters=True)
    # Where the reaper's drop transaction starts, read from a wrapper around
    # the real partitions.drop_if_dead (which runs unchanged): the reaper
    # first counts the day's rows and moves its live ones out, then drops.
    real_drop, drop_started = partitions.drop_if_dead, []
    # A key of today's partition, which the drop leaves alone: a request
    # for it waits only if the drop's lock holds up the whole key table.
    today = partition_name(await conn.fetchval("SELECT key_table_day()"))
    today_key = await conn.fetchrow(f"SELECT client_id, key FROM {today} LIMIT 1")
    stop_looking, lookups = asyncio.Event(), []

    async def marked(*args: Any) -> bool:
        drop_started.append((time.monotonic(), await wal_lsn(conn)))
        if today_key is not None:
            lookups.append(asyncio.create_task(look_up_while(url, stop_looking, *today_key)))
        return await real_drop(*args)

    partitions.drop_if_dead = marked
    try:
        lsn, started = await wal_lsn(conn), time.monotonic()
        report = await retention.reap(engine, reap_retention)
        ended, end_lsn = time.monotonic(), await wal_lsn(conn)
    finally:
        partitions.drop_if_dead = real_drop
        stop_looking.set()
        await engine.dispose()
    took = (await lookups[0]) if lookups else []
    wal = await wal_between(conn, lsn, end_lsn)
    drop_seconds = drop_wal = None
    if drop_started:
        drop_seconds, drop_wal = ended - drop_started[0][0], await wal_between(conn, drop_started[0][1], end_lsn)
    moved = report.moved.get(name, 0)
    still_there = await conn.fetchval(
        "SELECT count(*) FROM idempotency_key k JOIN unnest($1::bigint[], $2::text[]) AS l(client_id, key) "
        "USING (client_id, key)", [c for c, _ in live], [k for _, k in live])
    checks = [
        Check("the reaper dropped exactly the day past its retention", report.dropped == [name],
              f"dropped {report.dropped}, kept {report.kept}"),
        Check("every live key of the dropped day is still in the key table", still_there == len(live) == moved,
              f"{len(live)} live before, {moved} moved, {still_there} found after"),
    ]
    removal = Removal("drop (the reaper)", name, rows, rows - moved, moved, ended - started, wal, before,
                      await sizes(conn, name), drop_seconds=drop_seconds, drop_wal_bytes=drop_wal, lookups=took)
    return removal, checks


async def delete_day(conn: asyncpg.Connection, day: date, retention: timedelta) -> tuple[Removal, list[Check]]:
    """The same removal by DELETE (finished keys past `retention`), then VACUUM of the partition."""
    name = partition_name(day)
    now = await conn.fetchval("SELECT key_table_clock()")
    cutoff = now - retention
    live = len(await _live_keys(conn, name, cutoff))
    rows = await conn.fetchval(f"SELECT count(*) FROM {name}")
    before = await sizes(conn, name)
    await conn.execute("CHECKPOINT")
    lsn, started = await wal_lsn(conn), time.monotonic()
    status = await conn.execute(
        "DELETE FROM idempotency_key WHERE stored_on = $1 AND state = 'finished' AND finished_at <= $2", day, cutoff)
    seconds, wal = time.monotonic() - started, await wal_since(conn, lsn)
    deleted = int(status.split()[-1])
    lsn, started = await wal_lsn(conn), time.monotonic()
    await conn.execute(f"VACUUM {name}")
    vacuum_seconds, vacuum_wal = time.monotonic() - started, await wal_since(conn, lsn)
    left = await conn.fetchval(f"SELECT count(*) FROM {name}")
    checks = [Check("the DELETE removed every finished key of its day and kept the live ones",
                    deleted == rows - live and left == live, f"{deleted} deleted of {rows}, {left} left, {live} live")]
    removal = Removal("DELETE, then VACUUM", name, rows, deleted, 0, seconds, wal, before, await sizes(conn, name),
                      vacuum_seconds, vacuum_wal)
    return removal, checks
