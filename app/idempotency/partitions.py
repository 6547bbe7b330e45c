"""The key table's daily partitions: created ahead, and dropped once wholly past retention.

Not on a request's path: the worker's daily tick and `payments keys reap`
call these (app/workers/retention.py), and `payments migrate` calls
`ensure_ahead` so that a freshly migrated database can take claims at once.
A claim only ever inserts into today's partition by the database's clock
(migration 0006). A day is removed in two steps: its live rows are moved to
today's partition (`move_live_rows`), then it is dropped whole if nothing
live is left (`drop_if_dead`). docs/key-table.md#reaping-moving-the-live-rows-out-then-dropping
explains why no live row can be lost, and why a DROP and not a DETACH.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

PARENT = "idempotency_key"
LEGACY = "idempotency_key_legacy"
# Days of partitions kept ready ahead of today: a worker that is down for
# less than this never leaves a claim without its partition.
AHEAD_DAYS = 7
# How long a DROP (or ATTACH) may wait for its lock before giving up: long
# enough for the key table's statements (single statements, milliseconds),
# short enough that the queries queued behind the waiting DDL barely notice.
LOCK_TIMEOUT = "500ms"


def partition_name(day: date) -> str:
    return f"{PARENT}_p{day:%Y%m%d}"


@dataclass(frozen=True)
class Partition:
    name: str
    # [lower, upper): lower is None for the legacy partition (MINVALUE).
    lower: date | None
    upper: date


_LIST = text(
    """
    SELECT c.relname AS name,
           (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \\(''([0-9-]+)''\\)'))[1] AS lower,
           (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \\(''([0-9-]+)''\\)'))[1] AS upper
      FROM pg_inherits i
      JOIN pg_class c ON c.oid = i.inhrelid
     WHERE i.inhparent = CAST(:parent AS regclass) AND c.relkind = 'r'
     ORDER BY upper
    """
)

_CLOCK = text("SELECT key_table_clock() AS now, key_table_day() AS today")


async def clock(conn: AsyncConnection) -> tuple[datetime, date]:
    """The key table's clock and its UTC day (the database's, see migration 0006)."""
    row = (await conn.execute(_CLOCK)).one()
    return row.now, row.today


async def list_partitions(conn: AsyncConnection) -> list[Partition]:
    rows = (await conn.execute(_LIST, dict(parent=PARENT))).all()
    return [
        Partition(r.name, date.fromisoformat(r.lower) if r.lower else None, date.fromisoformat(r.upper))
        for r in rows
    ]


async def ensure_ahead(conn: AsyncConnection, days: int = AHEAD_DAYS) -> list[str]:
    """Create the partitions of today and the next `days` days that are missing; their names.

    Run with autocommit: each partition is created as a table of its own and
    then ATTACHed, which takes SHARE UPDATE EXCLUSIVE on the key table (reads
    and writes go on) instead of the ACCESS EXCLUSIVE that CREATE TABLE ...
    PARTITION OF would take.
    """
    _, today = await clock(conn)
    created = []
    for day in missing_days(await list_partitions(conn), today, days):
        name = partition_name(day)
        await conn.execute(text(f"CREATE TABLE IF NOT EXISTS {name} (LIKE {PARENT} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"))
        await conn.execute(text(f"SET lock_timeout = '{LOCK_TIMEOUT}'"))
        try:
            await conn.execute(
                text(f"ALTER TABLE {PARENT} ATTACH PARTITION {name} FOR VALUES FROM ('{day}') TO ('{day + timedelta(days=1)}')")
            )
        finally:
            await conn.execute(text("RESET lock_timeout"))
        created.append(name)
    return created


def missing_days(existing: list[Partition], today: date, days: int = AHEAD_DAYS) -> list[date]:
    """Today and the next `days` days that no partition covers yet."""
    wanted = [today + timedelta(days=n) for n in range(days + 1)]
    return [d for d in wanted if not any((p.lower is None or p.lower <= d) and d < p.upper for p in existing)]


@dataclass(frozen=True)
class Plan:
    """What the reaper found in one partition wholly past retention."""

    partition: Partition
    rows: int  # every row in it
    live: int  # started, or finished less than retention ago: to be moved out
    held: int  # of those, rows with a live lease: they stay, and so does the partition


def past_retention(partitions: list[Partition], now: datetime, retention: timedelta, today: date) -> list[Partition]:
    """Partitions whose every row was stored more than `retention` ago (never today's)."""
    cutoff = now - retention
    return [
        p for p in partitions
        if p.upper <= today and datetime.combine(p.upper, time(), tzinfo=UTC) <= cutoff
    ]


def _live(alias: str = "k") -> str:
    # Never removed: a started key (in flight, stranded or parked), and a key
    # that finished less than retention ago (a long-parked payment settled
    # yesterday is answered for a full retention period after it settled).
    return f"({alias}.state = 'started' OR {alias}.finished_at > CAST(:cutoff AS timestamptz))"


def _lease_live(alias: str = "k") -> str:
    return f"({alias}.lease_expires_at IS NOT NULL AND {alias}.lease_expires_at >= now())"


async def plan(conn: AsyncConnection, partition: Partition, cutoff: datetime) -> Plan:
    row = (
        await conn.execute(
            text(
                f"SELECT count(*) AS rows, count(*) FILTER (WHERE {_live()}) AS live, "
                f"count(*) FILTER (WHERE {_live()} AND {_lease_live()}) AS held FROM {partition.name} k"
            ),
            dict(cutoff=cutoff),
        )
    ).one()
    return Plan(partition, row.rows, row.live, row.held)


async def move_live_rows(conn: AsyncConnection, partition: Partition, cutoff: datetime) -> int:
    """Move the live rows nobody holds to today's partition; how many moved.

    One statement (a transaction of its own). SKIP LOCKED passes over a row
    that an owner is updating at this instant instead of waiting for it; a
    row with a live lease is left alone too, because its owner will write it
    again soon, and a write that meets a row just moved to another partition
    fails (it cannot follow the row) and would cost that owner an attempt.
    """
    result = await conn.execute(
        text(
            f"""
            WITH live AS (
                SELECT k.client_id, k.key, k.stored_on FROM {partition.name} k
                 WHERE {_live()} AND NOT {_lease_live()}
                   FOR UPDATE SKIP LOCKED
            )
            UPDATE {PARENT} AS k SET stored_on = key_table_day()
              FROM live
             WHERE k.client_id = live.client_id AND k.key = live.key
               AND k.stored_on = live.stored_on
            """
        ),
        dict(cutoff=cutoff),
    )
    return result.rowcount


async def drop_if_dead(conn: AsyncConnection, partition: Partition, cutoff: datetime) -> bool:
    """Drop the partition if it holds nothing live; False (and nothing dropped) otherwise.

    Runs in the caller's transaction. The key table and then the partition
    are locked the way the DROP would lock them, and the partition is checked
    once more under that lock: a started row found there (which no code can
    put there after the move, but this is the last line of defence) keeps it.
    The recently-finished rows were counted before the lock (a seq scan of a
    whole day is too long to hold it for); a finished row only gets older.
    """
    await conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
    await conn.execute(text(f"LOCK TABLE ONLY {PARENT} IN ACCESS EXCLUSIVE MODE"))
    # Under that lock nobody else can drop it: gone now means another reaper
    # (the worker's tick, `payments keys reap`) dropped it first.
    if (await conn.execute(text("SELECT to_regclass(:name)"), dict(name=partition.name))).scalar_one() is None:
        return False
    await conn.execute(text(f"LOCK TABLE {partition.name} IN ACCESS EXCLUSIVE MODE"))
    started = (
        await conn.execute(
            text(
                f"SELECT EXISTS (SELECT 1 FROM {partition.name} WHERE state = 'started' AND parked_at IS NULL) "
                f"OR EXISTS (SELECT 1 FROM {partition.name} WHERE state = 'started' AND parked_at IS NOT NULL)"
            )
        )
    ).scalar_one()
    if started:
        return False
    await conn.execute(text(f"DROP TABLE {partition.name}"))
    return True
