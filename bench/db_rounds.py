"""`python -m bench.db_rounds`: does the database's cost per payment grow within a run?

A diagnostic beside `make bench`, not part of it. One phased API
(`payments api`, one worker) and the fakes run against fresh bench
databases (bench/system.py: the service's `payments_bench`, the fakes'
`payments_bench_rails`), and the same load of new payments is sent in
rounds, one after the other, with nothing in between. After each round the
database's cost of that round's payments is read, for each database apart:

shared buffers hit + read per payment (pg_stat_statements, by database)
    The figure the machine's noise does not move: how many pages the
    statements touched. It is published as each statement ends, so no
    idling is needed. The server must load pg_stat_statements
    (`shared_preload_libraries`); without it the figure is n/a.
CPU ms per payment of the database's backends (bench/costs.py's CpuMeter)
    Noisy on a shared machine; shown for the trend.
rows read per payment, per table (pg_stat_user_tables)
    seq_tup_read and idx_tup_fetch: a lookup that reads more rows as its
    table grows shows here by name. These counters are published up to 10 s
    after a backend goes idle, so the bench idles STATS_SETTLE_SECONDS
    after each round before reading them.
sizes, dead tuples, autovacuum runs (per table, after each round)
    Bloat of a row or an index that every payment updates.
the statements whose buffers per call grew most from the first round to the last
    By query text, each database apart: where the growth is, if there is any.
the btree indexes that gained a level in a round (pageinspect's bt_metap)
    A descent into an index reads one page per level, so every insert into
    or look in an index that gains a level touches one buffer more from
    then on. That is a step at a size (a level holds a few hundred times
    the one below it), not a cost that grows with every payment; this
    names the step when the buffers rise. The bench creates pageinspect
    in its databases; where it cannot, the levels are n/a.

The exactly-once check runs once, over all rounds, at the end (so its reads
do not land in a round). Results: the terminal and
bench/results/db-rounds-<UTC>.json.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from typing import Any

import asyncpg
import typer

from bench import costs
from bench.checks import exactly_once
from bench.costs import STATS_SETTLE_SECONDS, CpuMeter
from bench.load import Load, RunResult
from bench.system import (
    PHASED, RAILS_DATABASE, RESULTS, SERVICE_DATABASE, apis, console, database_server, fakes, prepare_databases,
    running,
)

DATABASES = (SERVICE_DATABASE, RAILS_DATABASE)
COUNTERS = ("calls", "rows", "shared_blks_hit", "shared_blks_read", "shared_blks_dirtied", "wal_bytes")
# Statements of this module carry this comment, so that its own reads can be left out
# (pg_stat_statements drops a leading comment from the text it keeps, hence a trailing one).
PROBE = "-- db_rounds probe"


async def statements(conn: asyncpg.Connection) -> dict[tuple[str, str], dict[str, Any]] | None:
    """pg_stat_statements by (database, query text): calls, rows, buffers; None if it is not loaded."""
    try:
        rows = await conn.fetch(
            f"""SELECT d.datname, s.queryid, s.query, s.calls, s.rows,
                       s.shared_blks_hit, s.shared_blks_read, s.shared_blks_dirtied, s.wal_bytes
                  FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
                 WHERE d.datname = ANY($1::text[]) AND s.query NOT LIKE '%db_rounds probe%'
               {PROBE}""",
            list(DATABASES),
        )
    except asyncpg.PostgresError:
        return None
    # By text: one statement can have two query ids (a plan's search path, say), one text is one statement.
    by_text: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        entry = by_text.setdefault((r["datname"], r["query"]), {"query": r["query"]} | {k: 0 for k in COUNTERS})
        for k in COUNTERS:
            entry[k] += r[k]
    return by_text


async def sessions(conn: asyncpg.Connection) -> dict[str, int]:
    """Sessions opened so far, per database: a new backend's first statements read the catalogs
    (hundreds of buffers), so a pool that opens connections mid-run shows in that round's buffers."""
    await conn.execute(f"SELECT pg_stat_clear_snapshot() {PROBE}")
    return dict(await conn.fetch(f"SELECT datname, sessions FROM pg_stat_database WHERE datname = ANY($1::text[]) "
                                 f"{PROBE}", list(DATABASES)))


async def tables(url: str) -> dict[str, dict[str, Any]]:
    """Per table (partitions apart): counters, dead tuples, autovacuum runs, sizes."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f"SELECT pg_stat_clear_snapshot() {PROBE}")
        rows = await conn.fetch(
            f"""SELECT schemaname || '.' || relname AS name, seq_scan, seq_tup_read,
                       coalesce(idx_scan, 0) AS idx_scan, coalesce(idx_tup_fetch, 0) AS idx_tup_fetch,
                       n_tup_ins, n_tup_upd, n_tup_hot_upd, n_live_tup, n_dead_tup,
                       autovacuum_count, autoanalyze_count,
                       pg_table_size(relid) AS table_bytes, pg_indexes_size(relid) AS index_bytes
                  FROM pg_stat_user_tables {PROBE}"""
        )
    finally:
        await conn.close()
    return {r["name"]: dict(r) for r in rows}


async def index_levels(url: str) -> dict[str, int] | None:
    """Each btree index's level (0: its root is its only leaf) outside the catalogs; None without pageinspect."""
    conn = await asyncpg.connect(url)
    try:
        try:
            await conn.execute(f"CREATE EXTENSION IF NOT EXISTS pageinspect {PROBE}")
        except asyncpg.PostgresError:
            return None
        rows = await conn.fetch(
            f"""SELECT n.nspname || '.' || c.relname AS name, (bt_metap(c.oid::regclass::text)).level
                  FROM pg_class c
                  JOIN pg_namespace n ON n.oid = c.relnamespace
                  JOIN pg_am a ON a.oid = c.relam
                 WHERE c.relkind = 'i' AND a.amname = 'btree'
                   AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast') {PROBE}"""
        )
    finally:
        await conn.close()
    return {r["name"]: r["level"] for r in rows}


def deeper(after: dict[str, int] | None, before: dict[str, int] | None) -> dict[str, list[int]]:
    """The indexes whose level rose between two readings: name -> [level before, level after]."""
    if after is None or before is None:
        return {}
    return {name: [before.get(name, 0), level] for name, level in after.items() if level > before.get(name, 0)}


def delta(after: dict[str, Any], before: dict[str, Any] | None, keys: tuple[str, ...]) -> dict[str, int]:
    return {k: after[k] - (before or {}).get(k, 0) for k in keys}


TABLE_COUNTERS = ("seq_scan", "seq_tup_read", "idx_scan", "idx_tup_fetch", "n_tup_ins", "n_tup_upd",
                  "n_tup_hot_upd", "autovacuum_count", "autoanalyze_count")


async def measure(rounds: int, duration: float, concurrency: int, warmup: float) -> dict[str, Any]:
    results: dict[str, Any] = {"rounds": []}
    with database_server() as server:
        dbs = prepare_databases(server)
        psp, rail = fakes(dbs.rails_url)
        api = apis(dbs.service_url, psp, rail, 1)[PHASED]
        urls = {SERVICE_DATABASE: dbs.service_url, RAILS_DATABASE: dbs.rails_url}
        with running([psp, rail, api]):
            conn = await asyncpg.connect(server.url)
            try:
                meter = CpuMeter(conn)
                await meter.setup()
                if await statements(conn) is None:
                    console.print("[red]pg_stat_statements is not loaded: buffers per payment n/a[/]")
                roles = lambda: {"API": api.tree(), "fake PSP": psp.tree(), "fake rail": rail.tree()}  # noqa: E731
                all_runs: list[RunResult] = []
                async with Load(api.url, dbs.api_key, concurrency) as load:
                    all_runs.append(await load.new_payments(warmup))  # warm-up: connections, caches; not counted
                    results["warmup_payments"] = all_runs[0].succeeded
                    await asyncio.sleep(STATS_SETTLE_SECONDS)
                    stmts_before = await statements(conn)
                    tables_before = {db: await tables(url) for db, url in urls.items()}
                    levels_before = {db: await index_levels(url) for db, url in urls.items()}
                    sessions_before = await sessions(conn)
                    for number in range(1, rounds + 1):
                        cpu_before = await meter.mark(roles())
                        run = await load.new_payments(duration)
                        cpu_after = await meter.mark(roles())
                        stmts_after = await statements(conn)
                        await asyncio.sleep(STATS_SETTLE_SECONDS)
                        tables_after = {db: await tables(url) for db, url in urls.items()}
                        levels_after = {db: await index_levels(url) for db, url in urls.items()}
                        sessions_after = await sessions(conn)
                        all_runs.append(run)
                        n = run.succeeded
                        spent = CpuMeter.spent(cpu_before, cpu_after)
                        figures: dict[str, Any] = {"round": number, "payments": n,
                                                   "per_second": round(run.per_second, 1),
                                                   "statuses": dict(run.statuses), "databases": {}}
                        for db in DATABASES:
                            per_db: dict[str, Any] = {
                                "cpu_ms_per_payment": round(spent.get(costs.PG_PARTS[db], 0.0) * 1000 / n, 3),
                                # the probes' own sessions (tables() and index_levels() above) are two per round
                                "sessions_opened": sessions_after.get(db, 0) - sessions_before.get(db, 0) - 2,
                            }
                            if stmts_after is not None and stmts_before is not None:
                                by_query = {}
                                for key, after in stmts_after.items():
                                    if key[0] != db:
                                        continue
                                    d = delta(after, stmts_before.get(key), COUNTERS)
                                    if d["calls"]:
                                        by_query[key[1][:300]] = d | {"query": key[1][:200]}
                                hit = sum(q["shared_blks_hit"] for q in by_query.values())
                                read = sum(q["shared_blks_read"] for q in by_query.values())
                                per_db |= {"buffers_per_payment": round((hit + read) / n, 2),
                                           "read_per_payment": round(read / n, 3),
                                           "calls_per_payment": round(sum(q["calls"] for q in by_query.values()) / n, 2),
                                           "statements": by_query}
                            per_table = {}
                            for name, after in tables_after[db].items():
                                d = delta(after, tables_before[db].get(name), TABLE_COUNTERS)
                                per_table[name] = d | {k: after[k] for k in ("n_live_tup", "n_dead_tup",
                                                                            "table_bytes", "index_bytes")}
                            per_db["rows_read_per_payment"] = round(
                                sum(t["seq_tup_read"] + t["idx_tup_fetch"] for t in per_table.values()) / n, 2)
                            per_db["tables"] = per_table
                            per_db["indexes_deeper"] = (None if levels_after[db] is None
                                                        else deeper(levels_after[db], levels_before[db]))
                            figures["databases"][db] = per_db
                        results["rounds"].append(figures)
                        line = ", ".join(
                            f"{db.removeprefix('payments_bench') or 'service'}: "
                            f"{figures['databases'][db].get('buffers_per_payment', 'n/a')} buf, "
                            f"{figures['databases'][db]['rows_read_per_payment']} rows, "
                            f"{figures['databases'][db]['cpu_ms_per_payment']} CPU ms"
                            for db in DATABASES)
                        console.print(f"round {number}: {n} payments ({run.per_second:.0f}/s); per payment {line}")
                        for db in DATABASES:
                            for name, (was, now) in (figures["databases"][db]["indexes_deeper"] or {}).items():
                                console.print(f"  a level more: {name} ({was} -> {now})")
                        stmts_before, tables_before, sessions_before = stmts_after, tables_after, sessions_after
                        levels_before = levels_after
                merged = RunResult()
                for r in all_runs:
                    merged.paid += r.paid
                    merged.references += r.references
                    merged.latencies += r.latencies
                    merged.statuses.update(r.statuses)
                checks = await exactly_once(PHASED, dbs.service_url, dbs.rails_url, dbs.client_id, merged)
                results["exactly_once"] = {"pass": all(c.ok for c in checks),
                                           "failed": [c.name for c in checks if not c.ok]}
                console.print("exactly-once: " + ("ok" if results["exactly_once"]["pass"] else
                                                  f"[red]FAILED[/] {results['exactly_once']['failed']}"))
            finally:
                await conn.close()
    return results


def growers(results: dict[str, Any], top: int = 8) -> dict[str, list[dict[str, Any]]]:
    """Per database: the statements whose buffers per payment changed most from the first round to the last."""
    first, last = results["rounds"][0], results["rounds"][-1]
    out: dict[str, list[dict[str, Any]]] = {}
    for db in DATABASES:
        a = first["databases"][db].get("statements", {})
        b = last["databases"][db].get("statements", {})
        rows = []
        for qid in set(a) | set(b):
            qa, qb = a.get(qid, {}), b.get(qid, {})
            per = lambda q, n: (q.get("shared_blks_hit", 0) + q.get("shared_blks_read", 0)) / n  # noqa: E731
            rows.append({"query": (qb or qa)["query"],
                         "first": round(per(qa, first["payments"]), 3), "last": round(per(qb, last["payments"]), 3),
                         "calls_per_payment_last": round(qb.get("calls", 0) / last["payments"], 2)})
        rows.sort(key=lambda r: -abs(r["last"] - r["first"]))
        out[db] = rows[:top]
    return out


def last_over_first(results: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per database: the last round's cost per payment over the first's, by buffers and by CPU."""
    first, last = results["rounds"][0]["databases"], results["rounds"][-1]["databases"]
    out: dict[str, dict[str, float | None]] = {}
    for db in DATABASES:
        ratios: dict[str, float | None] = {}
        for figure in ("buffers_per_payment", "cpu_ms_per_payment"):
            a, b = first[db].get(figure), last[db].get(figure)
            ratios[figure] = round(b / a, 3) if a and b is not None else None
        out[db] = ratios
    return out


def main(
    rounds: int = typer.Option(6, min=2, help="Rounds of new payments, one after the other."),
    duration: float = typer.Option(15.0, min=1, help="Seconds of each round."),
    concurrency: int = typer.Option(16, min=1, help="Concurrent clients."),
    warmup: float = typer.Option(2.0, min=0.1, help="Seconds of new payments before the first round (not counted)."),
) -> None:
    """Rounds of new payments; the database's cost per payment in each, the service's and the fakes' apart."""
    started_at = datetime.now(UTC)
    clock = time.monotonic()
    results = asyncio.run(measure(rounds, duration, concurrency, warmup))
    results |= {"timestamp": started_at.isoformat(timespec="seconds"),
                "wall_clock_s": round(time.monotonic() - clock, 1),
                "parameters": {"rounds": rounds, "duration_s": duration, "concurrency": concurrency,
                               "warmup_s": warmup}}
    if len(results["rounds"]) >= 2:
        results["last_over_first"] = last_over_first(results)
        for db, ratios in results["last_over_first"].items():
            console.print(f"[bold]{db}[/]: last round / first, per payment: "
                          f"buffers {ratios['buffers_per_payment']}, CPU {ratios['cpu_ms_per_payment']}")
        results["growers"] = growers(results)
        for db, rows in results["growers"].items():
            console.print(f"[bold]{db}[/]: buffers per payment, first round -> last, by statement")
            for r in rows:
                console.print(f"  {r['first']:8.2f} -> {r['last']:8.2f}  ({r['calls_per_payment_last']} calls/payment)  "
                              f"{r['query'][:110]!r}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"db-rounds-{started_at.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    console.print(f"results: {path}")
    if not results.get("exactly_once", {}).get("pass"):
        raise typer.Exit(1)


if __name__ == "__main__":
    typer.run(main)
