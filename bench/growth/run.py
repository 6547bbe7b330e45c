"""`make bench-growth`: the API on an empty key table and on one holding millions of keys, side by side.

Only ratios measured in one run mean anything on a shared 2-CPU machine
(docs/reference/performance.md), so the sizes are never compared across runs:
two copies of the service run at once, `payments api` on an empty database
and `payments api` on the preloaded one, and the same load drives them in
turn, alternating which goes first, round after round (as `make bench`
alternates the phased service and the naive twin, to cancel drift).

    create payments_growth_empty, payments_growth (the preloaded one),
    payments_growth_rails (the fakes' records); give both service databases
    the production layout (layout.py); start the fake PSP and rail and the two APIs
    for each size (1,000,000 then 10,000,000 by default):
        preload the database up to that many payments and keys (preload.py),
        VACUUM ANALYZE, check a sample of stored responses against the
        service's own rendering
        for each round: new payments on each database (warm-up, measured run,
            the exactly-once check), then replays of the keys each run just
            made (byte-identical, nothing charged), then, on the preloaded
            database, replays of preloaded keys sampled over the whole window
    one day dropped by the reaper vs one identical day DELETEd (reaping.py)
    report; JSON in bench/results/growth-<UTC>.json; drop the databases
    (unless --keep)

The figures: new payments/s and p99, replays/s and p99, on each database,
and preloaded ÷ empty; the targets are 0.8 or better for both rates at the
largest size. Replays of preloaded keys have no counterpart on the empty
database (it has no old keys); their ratio to the empty database's replays
is printed for what it shows (a replay that has to read a cold part of a
large index), not as a target. Targets are printed, never a reason to fail;
the exit status is 1 only if a check fails (exactly-once, a replay that is
not byte-identical, a live key lost by the reaper), and non-zero on a crash.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import typer

from app.config import Settings, libpq_url
from bench.checks import Check, exactly_once, replays_check
from bench.growth import layout, preload, reaping, report
from bench.growth.report import EMPTY, GROWN, NEW, OLD_REPLAYS, REPLAYS
from bench.load import Load, Paid, RunResult, payment_body
from bench.run import _interrupt, _loop_factory, machine
from bench.system import RESULTS, Service, console, database_server, fakes, running
from devtools.system import System

EMPTY_DATABASE = "payments_growth_empty"
GROWN_DATABASE = "payments_growth"
RAILS_DATABASE = "payments_growth_rails"
REPLAY_KEYS = 1000
# Bytes on disk per preloaded payment with its key (tables, indexes), measured at
# 100,000 rows; the disk check before each load asks for 1.5 times that.
BYTES_PER_ROW = 2600
DEFAULT_ROWS = "1000000,10000000"


@dataclass(frozen=True)
class Params:
    sizes: list[int]
    seconds: float
    replay_seconds: float
    warmup: float
    rounds: int
    concurrency: int
    workers: int
    day_rows: int
    clients: int
    connections: int
    retention_hours: float


@dataclass(frozen=True)
class Database:
    name: str  # EMPTY or GROWN
    url: str
    api_key: str
    client_ids: list[int]  # the bench's client first


def retention_hours() -> float:
    """KEY_RETENTION_HOURS as the APIs will read it: the environment's, else the documented default."""
    value = os.environ.get("KEY_RETENTION_HOURS")
    return float(value) if value else float(Settings.model_fields["key_retention_hours"].default)


class Growth:
    """The measured part of one run: the preloads, the API runs at each size, the removal of a day."""

    def __init__(self, params: Params, dbs: dict[str, Database], rails_url: str, apis: dict[str, Service]) -> None:
        self.p, self.dbs, self.rails_url, self.apis = params, dbs, rails_url, apis
        self.runs: list[dict[str, Any]] = []
        self.checks: list[Check] = []
        self.preloads: list[dict[str, Any]] = []
        self.loaded = 0

    async def __call__(self) -> dict[str, Any]:
        conn = await asyncpg.connect(self.dbs[GROWN].url)
        try:
            about = await machine(conn)
            for size in self.p.sizes:
                await self.preload(conn, size)
                await self.measure_size(conn, size)
            removal = await self.removal(conn)
        finally:
            await conn.close()
        return {"machine": about, "preloads": self.preloads, "runs": self.runs, "removal": removal,
                "checks": [c.__dict__ for c in self.checks]}

    # -- the preload --------------------------------------------------------

    async def preload(self, conn: asyncpg.Connection, size: int) -> None:
        now = await conn.fetchval("SELECT key_table_clock()")
        start = now - timedelta(hours=self.p.retention_hours)
        await disk_check(conn, size - self.loaded + 2 * self.p.day_rows)
        rows = size - self.loaded
        with console.status(f"preloading {rows:,} payments and keys") as status:
            def progress(done: int, seconds: float) -> None:
                status.update(f"preloading: {done:,} of {rows:,} payments and keys, {done / seconds:,.0f}/s")

            seconds = await preload.load(self.dbs[GROWN].url, self.dbs[GROWN].client_ids, self.loaded + 1, size + 1,
                                         start, now, preload.WINDOW_MIX, progress, self.p.connections)
            status.update(f"VACUUM (ANALYZE) of {size:,} payments and keys")
            vacuum = await preload.vacuum_analyze(conn)
        self.loaded = size
        key_rows = await conn.fetchval("SELECT count(*) FROM idempotency_key")
        per_day = await conn.fetch("SELECT stored_on, count(*) AS n FROM idempotency_key GROUP BY 1 ORDER BY 1")
        wrong = await preload.check_rendering(conn)
        self.checks.append(Check(f"preloaded responses at {size:,} are the service's own rendering", not wrong,
                                 "; ".join(wrong[:2]) or "20 of 20 byte-identical"))
        database_bytes = await conn.fetchval("SELECT pg_database_size(current_database())")
        days_text = ", ".join(f"{r['stored_on']}: {r['n']:,}" for r in per_day)
        self.preloads.append({"size": size, "rows": rows, "seconds": round(seconds, 1),
                              "vacuum_seconds": round(vacuum, 1), "key_rows": key_rows,
                              "key_rows_by_day": {str(r["stored_on"]): r["n"] for r in per_day},
                              "database_bytes": database_bytes})
        console.print(f"preloaded {rows:,} payments and keys in {seconds:.0f} s ({rows / seconds:,.0f}/s), "
                      f"VACUUM ANALYZE {vacuum:.0f} s; the key table holds {key_rows:,} rows "
                      f"({days_text}); "
                      f"database {database_bytes / 2**30:.1f} GiB")

    # -- the API runs -------------------------------------------------------

    async def measure_size(self, conn: asyncpg.Connection, size: int) -> None:
        p = self.p
        console.rule(f"{size:,} preloaded: {p.rounds} round{'s' if p.rounds > 1 else ''}, {p.concurrency} clients")
        key_rows = await conn.fetchval("SELECT count(*) FROM idempotency_key")
        old = await self.old_keys(conn)
        loads = {db: Load(self.apis[db].url, self.dbs[db].api_key, p.concurrency) for db in (EMPTY, GROWN)}
        for load in loads.values():
            await load.__aenter__()
        try:
            for round_ in range(1, p.rounds + 1):
                order = (EMPTY, GROWN) if round_ % 2 else (GROWN, EMPTY)
                paid: dict[str, list[Paid]] = {}
                for db in order:
                    d = self.dbs[db]
                    result = await self.run(size, key_rows, round_, NEW, db, loads[db].new_payments, p.seconds,
                                            lambda run, d=d: exactly_once("phased", d.url, self.rails_url,
                                                                          d.client_ids[0], run))
                    paid[db] = result.paid[:REPLAY_KEYS]
                for db in order:
                    if not paid[db]:
                        self.checks.append(Check(f"{db}: a payment finished to replay", False, "none did"))
                        continue
                    await self.run(size, key_rows, round_, REPLAYS, db,
                                   lambda s, db=db: loads[db].replays(paid[db], s), p.replay_seconds,
                                   lambda run, db=db: replays_check(self.rails_url, run, paid[db]))
                if not old:
                    self.checks.append(Check("preloaded keys of the bench's client to replay", False, "none found"))
                    continue
                await self.run(size, key_rows, round_, OLD_REPLAYS, GROWN,
                               lambda s: loads[GROWN].replays(old, s), p.replay_seconds,
                               lambda run: self.old_replays_check(run, old))
        finally:
            for load in loads.values():
                await load.__aexit__(None, None, None)

    async def run(self, size: int, key_rows: int, round_: int, kind: str, db: str,
                  drive: Callable[[float], Awaitable[RunResult]], seconds: float,
                  check: Callable[[RunResult], Awaitable[list[Check]]]) -> RunResult:
        """Warm-up, the measured run, its checks; recorded, and one line printed."""
        label = f"[{size:,}] round {round_} {kind}, {db}"
        with console.status(f"{label}: warm-up {self.p.warmup:g} s"):
            await drive(self.p.warmup)
        with console.status(f"{label}: {seconds:g} s"):
            result = await drive(seconds)
        with console.status(f"{label}: checking"):
            checks = await check(result)
        summary = result.summary()
        self.runs.append({
            "size": size, "key_rows": key_rows if db == GROWN else None, "round": round_, "kind": kind,
            "database": db, **summary, "latencies_s": result.latencies,
            "checks": [c.__dict__ for c in checks],
        })
        lat = summary["latency_ms"]
        ok = all(c.ok for c in checks)
        other = result.requests - result.succeeded
        console.print(f"{label}: {summary['per_second']:,.0f}/s, p50 {report.fmt(lat['p50'])} ms, "
                      f"p99 {report.fmt(lat['p99'])} ms" + (f", [yellow]{other} not as expected[/]" if other else "")
                      + ("; [green]ok[/]" if ok else "; [bold red]FAIL[/]"))
        return result

    async def old_keys(self, conn: asyncpg.Connection) -> list[Paid]:
        """Up to REPLAY_KEYS finished, succeeded preloaded keys of the bench's client, drawn from the whole window."""
        clients = len(self.dbs[GROWN].client_ids)
        # The bench's client is the first of the list: the preload gives it row n when n % clients == 0.
        candidates = random.Random(self.loaded).sample(range(clients, self.loaded + 1, clients),
                                                       min(self.loaded // clients, 2 * REPLAY_KEYS))
        rows = await conn.fetch(
            "SELECT k.key, p.reference, k.response_body FROM payment p "
            "JOIN idempotency_key k ON k.payment_id = p.id AND k.client_id = p.client_id "
            "WHERE p.client_id = $1 AND p.reference = ANY($2::text[]) AND p.status = 'succeeded' "
            "AND k.state = 'finished' LIMIT $3",
            self.dbs[GROWN].client_ids[0], [f"order-{n}" for n in candidates], REPLAY_KEYS,
        )
        random.Random(0).shuffle(rows := list(rows))
        return [Paid(r["key"], r["reference"], payment_body(r["reference"]), r["response_body"].encode()) for r in rows]

    async def old_replays_check(self, run: RunResult, old: list[Paid]) -> list[Check]:
        """Every replay of a preloaded key got its stored bytes, and none reached the PSP or the rail."""
        references = [p.reference for p in old]
        conn = await asyncpg.connect(self.rails_url)
        try:
            charged = await conn.fetchval("SELECT count(*) FROM fake_psp.charge WHERE reference = ANY($1::text[])",
                                          references)
            sent = await conn.fetchval("SELECT count(*) FROM fake_rail.transfer WHERE reference = ANY($1::text[])",
                                       references)
        finally:
            await conn.close()
        wrong = run.requests - run.succeeded
        return [
            Check("every replay of a preloaded key got its stored 201 back, byte for byte",
                  wrong == 0 and run.succeeded > 0 and len(old) > 0,
                  f"{run.succeeded} replayed over {len(old)} keys, {wrong} did not: {dict(run.statuses)}"),
            Check("replays of preloaded keys charged and paid out nothing", charged == 0 and sent == 0,
                  f"{charged} charges, {sent} transfers for their references"),
        ]

    # -- the removal of a day -----------------------------------------------

    async def removal(self, conn: asyncpg.Connection) -> dict[str, Any]:
        p = self.p
        today = await conn.fetchval("SELECT key_table_day()")
        days = layout.reap_days(today, p.retention_hours)
        with console.status(f"preloading two identical old days of {p.day_rows:,} keys each "
                            f"({days.drop} to drop, {days.delete} to DELETE)"):
            for day in (days.drop, days.delete):
                await layout.attach_day(conn, day)
                start = datetime.combine(day, datetime.min.time(), tzinfo=UTC)
                # Row numbers of their own, past everything loaded (references stay unique per client);
                # the same count and mix in both days.
                first = 10 ** (len(str(self.loaded + p.day_rows)) + 1) * (1 if day == days.drop else 2)
                await preload.load(self.dbs[GROWN].url, self.dbs[GROWN].client_ids, first, first + p.day_rows,
                                   start, start + timedelta(days=1), preload.OLD_DAY_MIX, connections=p.connections)
            await conn.execute(f"VACUUM (ANALYZE) {layout.partition_name(days.drop)}, "
                               f"{layout.partition_name(days.delete)}")
        with console.status(f"dropping {days.drop} with the reaper"):
            drop, checks = await reaping.drop_day(self.dbs[GROWN].url, conn, days.drop, days.reap_retention)
        self.checks += checks
        console.print(f"drop {drop.partition} by the reaper: {drop.rows_removed:,} rows in {drop.seconds:.3f} s "
                      f"(the drop transaction {report.fmt(drop.drop_seconds, 3)} s), "
                      f"{drop.wal_bytes:,} bytes of WAL ({drop.rows_moved} live rows moved out first)")
        with console.status(f"DELETE of {days.delete}'s finished keys, then VACUUM"):
            delete, checks = await reaping.delete_day(conn, days.delete, timedelta(hours=p.retention_hours))
        self.checks += checks
        console.print(f"DELETE from {delete.partition}: {delete.rows_removed:,} rows in {delete.seconds:.3f} s, "
                      f"{delete.wal_bytes:,} bytes of WAL; VACUUM {delete.vacuum_seconds:.2f} s, "
                      f"{delete.vacuum_wal_bytes:,} bytes of WAL")
        return {"days": {"drop": str(days.drop), "delete": str(days.delete)},
                "reap_retention_hours": days.reap_retention.total_seconds() / 3600,
                "drop": drop.to_json(), "delete": delete.to_json()}


async def disk_check(conn: asyncpg.Connection, rows: int) -> None:
    """Refuse to start a load the server's disk cannot hold (when the data directory is on this machine)."""
    try:
        data_dir = Path(await conn.fetchval("SHOW data_directory"))
        free = shutil.disk_usage(data_dir).free
    except (asyncpg.PostgresError, OSError):
        return  # another machine, or not ours to read: the server will say if it runs out
    needed = int(rows * BYTES_PER_ROW * 1.5)
    if needed > free:
        raise DiskTooSmall(f"{rows:,} more rows need about {needed / 2**30:.1f} GiB; "
                           f"{free / 2**30:.1f} GiB free at {data_dir}")


class DiskTooSmall(Exception):
    pass


def api_on(database_url: str, psp: Service, rail: Service, workers: int, name: str, retention: float) -> Service:
    system = System()
    system.database_url, system.psp, system.rail = database_url, psp, rail
    process = system.api_process(args=("--workers", str(workers)), KEY_RETENTION_HOURS=f"{retention:g}")
    return Service.of(process, name, processes=1 if workers == 1 else workers + 1)


def prepare(server_system: System, keep: bool, clients: int, retention: float) -> tuple[dict[str, Database], str]:
    """The three databases, fresh, with the production layout and the clients; dropped at the end unless `keep`."""
    rails_url = server_system.create_database(RAILS_DATABASE, migrate=False, drop_at_end=not keep)
    dbs = {}
    for db, name in ((EMPTY, EMPTY_DATABASE), (GROWN, GROWN_DATABASE)):
        url = libpq_url(server_system.create_database(name, drop_at_end=not keep))
        bench_id, api_key = server_system.create_client("bench")
        others = [server_system.create_client(f"growth-{n}")[0] for n in range(1, clients)] if db == GROWN else []
        dbs[db] = Database(db, url, api_key, [bench_id, *others])

    async def lay_out() -> None:
        for d in dbs.values():
            conn = await asyncpg.connect(d.url)
            try:
                now = await conn.fetchval("SELECT key_table_clock()")
                await layout.production_layout(conn, layout.window_days(now, retention))
            finally:
                await conn.close()

    asyncio.run(lay_out())
    return dbs, rails_url


def main(
    rows: str = typer.Option(DEFAULT_ROWS, help="Preloaded payments (and keys), comma-separated, ascending."),
    seconds: float = typer.Option(20.0, min=1, help="Seconds of each measured run of new payments."),
    replay_seconds: float = typer.Option(None, min=1, help="Seconds of each measured run of replays "
                                                           "(default: --seconds, at most 10)."),
    warmup: float = typer.Option(2.0, min=0, help="Seconds of warm-up before each measured run (not counted)."),
    rounds: int = typer.Option(3, min=1, help="Rounds per size, each driving both databases, alternating."),
    concurrency: int = typer.Option(32, min=1, help="Concurrent clients."),
    workers: int = typer.Option(1, min=1, help="Worker processes of each API."),
    day_rows: int = typer.Option(1_000_000, min=100, help="Keys in each of the two old days (drop vs DELETE)."),
    clients: int = typer.Option(10, min=1, help="Clients the preloaded rows are dealt to (the bench's among them)."),
    connections: int = typer.Option(2, min=1, help="Connections writing the preload side by side."),
    keep: bool = typer.Option(False, "--keep", help="Keep the bench's databases afterwards (they are large)."),
) -> None:
    """The API on an empty key table vs one preloaded to each size, side by side; then a day dropped vs DELETEd."""
    replay_seconds = replay_seconds or min(seconds, 10.0)
    try:
        sizes = layout.parse_sizes(rows)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    params = Params(sizes, seconds, replay_seconds, warmup, rounds, concurrency, workers, day_rows, clients,
                    connections, retention_hours())
    signal.signal(signal.SIGTERM, _interrupt)
    started_at = datetime.now(UTC)
    clock = time.monotonic()
    loop_factory, loop_name = _loop_factory()
    try:
        with database_server() as server:
            with console.status("creating the bench databases"):
                dbs, rails_url = prepare(server.system, keep, clients, params.retention_hours)
            psp, rail = fakes(rails_url)
            apis = {db: api_on(dbs[db].url, psp, rail, workers, f"growth API ({db})", params.retention_hours)
                    for db in (EMPTY, GROWN)}
            with running([psp, rail, *apis.values()]), asyncio.Runner(loop_factory=loop_factory) as runner:
                measured = runner.run(Growth(params, dbs, rails_url, apis)())
            if keep:
                console.print(f"kept: {', '.join(d.url for d in dbs.values())}, {rails_url}")
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]: every process started here was stopped")
        raise typer.Exit(130) from None
    except DiskTooSmall as exc:
        console.print(f"[red]not enough disk[/]: {exc}")
        raise typer.Exit(2) from None

    results: dict[str, Any] = {
        "timestamp": started_at.isoformat(timespec="seconds"),
        "wall_clock_s": round(time.monotonic() - clock, 1),
        "parameters": {
            "sizes": sizes, "seconds": seconds, "replay_seconds": replay_seconds, "warmup_s": warmup,
            "rounds": rounds, "concurrency": concurrency, "workers": workers, "day_rows": day_rows,
            "clients": clients, "retention_hours": params.retention_hours, "replay_keys_max": REPLAY_KEYS,
            "server": "DATABASE_URL's server" if os.environ.get("DATABASE_URL") else "embedded PostgreSQL",
            "load_generator": f"aiohttp {aiohttp.__version__} on {loop_name}",
        },
        **measured,
    }
    results |= report.summarize(results)
    for run in results["runs"]:  # pooled into the summary; too many to keep
        del run["latencies_s"]
    report.print_report(results)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"growth-{started_at.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    console.print(f"results: {path}")
    if not results["checks_pass"]:
        raise typer.Exit(1)


cli = typer.Typer(add_completion=False)
cli.command()(main)

if __name__ == "__main__":
    cli()
