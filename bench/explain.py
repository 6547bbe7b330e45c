"""One new payment's cost in the database, statement by statement: `EXPLAIN (ANALYZE, BUFFERS, WAL)` of each.

    .venv/bin/python -m bench.explain [--warmup 200] [--payments 20] [--variants phased,naive] [--no-tree]
        [--json FILE]

Not on a request's path: a bench of its own. It starts an embedded
PostgreSQL of its own (a data directory of its own, a free port) with
PostgreSQL's `auto_explain` and `pg_stat_statements` preloaded, the fake
PSP and rail, and each variant's API natively (`payments api`,
`naive-twin`). It sends `warmup` payments one after another, resets
pg_stat_statements, sends `payments` more, and prints:

- each statement's cost a call as pg_stat_statements counted it over the
  measured payments: blocks, WAL, rows, and how often it was planned
  (`track_planning`): a statement planned on every call is a cost the
  execution figures do not show;
- the statements run inside those (the claim's function, the foreign keys'
  checks), already counted in the statement that ran them;
- the plan of the last payment's every statement, node by node, as
  auto_explain logged it (`ANALYZE`, `BUFFERS`, `WAL`, the triggers it
  fired): where a block or a WAL record comes from.

A phase's statement runs exactly as the service runs it, under its real
parameters and the plan the service's connection chose: nothing is
re-planned by hand. Its times are under auto_explain's instrumentation (a
timer around every node), so they are for comparing nodes, not the
service's speed; blocks, WAL and rows are not changed by it.

Run against DATABASE_URL's server it cannot preload a module, so it says
`NO FIGURE` and exits 1, as it does whenever nothing was logged.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import typer

from bench.instructions import reset_statements
from bench.instructions import STATEMENTS_SQL, COMMAND, NoFigure, Stack, known_phases, phase_of, send, show
from bench.system import LOGS, NAIVE, PHASED, RAILS_DATABASE, SERVICE_DATABASE, SETTINGS, console, fakes, running
from devtools import embedded_db
from devtools.processes import free_port
from devtools.system import System

# The server logs as JSON lines into its data directory, so a plan is one record to parse, never a
# multi-line message to reassemble.
LOGGING = (
    ("shared_preload_libraries", "auto_explain,pg_stat_statements"),
    ("pg_stat_statements.track", "all"),
    ("pg_stat_statements.track_planning", "on"),
    ("logging_collector", "on"),
    ("log_destination", "jsonlog"),
    ("log_directory", "log"),
    ("log_filename", "explain"),
    # Every statement, from the start: the warm-up's are logged too, and the figures are read off the
    # last `payments` payments' statements only.
    ("auto_explain.log_min_duration", "0"),
    ("auto_explain.log_analyze", "on"),
    ("auto_explain.log_buffers", "on"),
    ("auto_explain.log_wal", "on"),
    ("auto_explain.log_triggers", "on"),
    ("auto_explain.log_timing", "on"),
    ("auto_explain.log_nested_statements", "on"),
    ("auto_explain.log_format", "json"),
)
LOG_SECONDS = 30


@dataclass
class Explained:
    """One statement as run once: its name, text and plan, and the figures read off the plan."""

    name: str
    query: str
    plan: dict[str, Any]
    triggers: list[dict[str, Any]]
    ms: float
    nested: bool


def parse_log(text: str, database: str, phases: dict[str, str]) -> list[Explained]:
    """Every plan auto_explain logged for `database`, in order; the plan's own query text names it."""
    found = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        message = record.get("message", "")
        if record.get("dbname") != database or "plan:" not in message:
            continue
        head, _, body = message.partition("plan:")
        explained = json.loads(body)
        query = explained.get("Query Text", "")
        found.append(Explained(
            name=phase_of(query, phases), query=query, plan=explained["Plan"],
            triggers=explained.get("Triggers", []), ms=float(head.split()[1]),
            # A statement run inside another (by a function or a trigger) is logged before the one
            # that ran it finishes; the claim's function and the foreign keys' checks are those.
            nested=not _is_top_level(query, phases),
        ))
    return found


def _is_top_level(query: str, phases: dict[str, str]) -> bool:
    name = phase_of(query, phases)
    return name in phases.values() or name.startswith("the caller") or name == "the key's lookup"


def node_lines(plan: dict[str, Any], depth: int = 0) -> list[str]:
    """The plan tree, one line a node: what it is, on what, rows, and the blocks and WAL it counted."""
    what = plan.get("Node Type", "?")
    if plan.get("Operation") and what == "ModifyTable":
        what = plan["Operation"]
    on = plan.get("Relation Name") or plan.get("Function Name") or plan.get("CTE Name") or ""
    if plan.get("Index Name"):
        on += f" using {plan['Index Name']}"
    label = plan.get("Subplan Name") or plan.get("Parent Relationship") or ""
    rows = plan.get("Actual Rows", 0) * plan.get("Actual Loops", 1)
    line = (f"{'  ' * depth}{what} {on}".rstrip() + (f" [{label}]" if label else "")
            + f": rows {rows:g}, hit {plan.get('Shared Hit Blocks', 0)}, read {plan.get('Shared Read Blocks', 0)},"
            f" dirtied {plan.get('Shared Dirtied Blocks', 0)}, WAL {plan.get('WAL Records', 0)} rec"
            f" {plan.get('WAL Bytes', 0)} B ({plan.get('WAL FPI', 0)} FPI),"
            f" {plan.get('Actual Total Time', 0):.3f} ms")
    return [line, *(x for child in plan.get("Plans", []) for x in node_lines(child, depth + 1))]


def triggers_fired(runs: list[Explained], payments: int) -> str:
    """The triggers a statement fired, with their calls a payment (the foreign keys' checks are triggers)."""
    calls: dict[str, float] = defaultdict(float)
    for r in runs:
        for t in r.triggers:
            calls[f"{t.get('Trigger Name')} on {t.get('Relation')}"] += float(t.get("Calls", 0))
    return ", ".join(f"{name} x{n / payments:g}" for name, n in sorted(calls.items())) or "none"


async def _reset(url: str) -> None:
    """pg_stat_statements, created in this server of the bench's own, and emptied."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    finally:
        await conn.close()
    await reset_statements(url)


# The bench's own columns, and how often each statement was planned (track_planning).
_STATEMENTS_SQL = STATEMENTS_SQL.replace("s.toplevel", "s.toplevel, s.plans, s.mean_plan_time")


async def _statements(url: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetch(_STATEMENTS_SQL, SERVICE_DATABASE)
    finally:
        await conn.close()


async def _mark(url: str, marker: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f"SELECT '{marker}'")
    finally:
        await conn.close()


def logged_since(server: embedded_db.EmbeddedServer, offset: int, marker: str) -> str:
    """The server's JSON log from `offset` up to `marker`, a statement run last: the logger writes
    asynchronously, so the log is read once the marker has reached it."""
    path = server.data_dir / "log" / "explain.json"
    asyncio.run(_mark(server.url(SERVICE_DATABASE), marker))
    deadline = time.monotonic() + LOG_SECONDS
    while time.monotonic() < deadline:
        text = path.read_bytes()[offset:].decode(errors="replace") if path.exists() else ""
        if marker in text:
            return text
        time.sleep(0.1)
    raise NoFigure(f"the server's log {path} never showed the run's end marker within {LOG_SECONDS} s")


def profile_variant(stack: Stack, server: embedded_db.EmbeddedServer, variant: str, warmup: int,
                    payments: int) -> tuple[list[asyncpg.Record], dict[str, list[Explained]]]:
    """`warmup` then `payments` payments to `variant`'s API, one after another; the measured payments'
    statements as pg_stat_statements counted them, and as auto_explain logged them, by name."""
    path = server.data_dir / "log" / "explain.json"
    offset = path.stat().st_size if path.exists() else 0
    process = stack.system.api_process(f"explain-{variant}", command=COMMAND[variant], **SETTINGS[variant])
    process.log = LOGS / f"explain-{variant}.log"
    process.log.unlink(missing_ok=True)
    process.start()
    try:
        send(process.url, stack.api_key, warmup, 0, replayed=False)
        asyncio.run(_reset(server.url()))
        send(process.url, stack.api_key, payments, 0, replayed=False)
        counted = asyncio.run(_statements(server.url()))
    finally:
        process.stop()
    found = parse_log(logged_since(server, offset, f"bench-explain-end-{variant}-{time.time_ns()}"),
                      SERVICE_DATABASE, known_phases())
    if not found or not counted:
        raise NoFigure(f"auto_explain or pg_stat_statements recorded nothing for {SERVICE_DATABASE} (log in {path})")
    by_name: dict[str, list[Explained]] = defaultdict(list)
    for e in found:
        by_name[e.name].append(e)
    measured = {}
    for name, runs in by_name.items():
        # A statement run k times a payment was run k * (warmup + payments) times; its last k * payments
        # runs are the measured payments'.
        keep = round(len(runs) * payments / (warmup + payments))
        if keep:
            measured[name] = runs[-keep:]
    return counted, measured


def main(
    warmup: int = typer.Option(200, min=0, help="Payments before auto_explain is switched on."),
    payments: int = typer.Option(5, min=1, help="Payments explained, one after another."),
    variants: str = typer.Option(f"{PHASED},{NAIVE}", help="phased, naive or both."),
    tree: bool = typer.Option(True, help="Print the last payment's plan trees node by node."),
    json_out: Path = typer.Option(None, "--json", help="Write every logged plan to this file."),
) -> None:
    """Each statement of a new payment under EXPLAIN (ANALYZE, BUFFERS, WAL), as the service runs it."""
    chosen = [v.strip() for v in variants.split(",") if v.strip()]
    try:
        import os

        if os.environ.get("DATABASE_URL"):
            raise NoFigure("bench.explain preloads auto_explain into a server of its own; unset DATABASE_URL")
        root = Path(os.environ.get("PAYMENTS_DATA_DIR", Path.cwd() / ".data")).resolve()
        server = embedded_db.EmbeddedServer(root / "postgres-explain", free_port(), settings=LOGGING)
        with System(LOGS) as system:
            system.start_postgres(server)
            console.print(f"PostgreSQL (embedded, {server.data_dir}) on port {server.port}, auto_explain preloaded")
            system.create_database(RAILS_DATABASE, migrate=False)
            system.create_database(SERVICE_DATABASE)
            _, api_key = system.create_client("bench")
            with running(fakes(system.postgres.database_url(RAILS_DATABASE))) as (psp, rail):
                system.psp, system.rail = psp, rail
                stack = Stack(system, api_key)
                everything = {}
                for variant in chosen:
                    counted, measured = profile_variant(stack, server, variant, warmup, payments)
                    everything[variant] = {name: [dict(ms=e.ms, query=e.query, plan=e.plan, triggers=e.triggers)
                                                  for e in runs] for name, runs in measured.items()}
                    phases = known_phases()
                    top = [r for r in counted if r["toplevel"] and not phase_of(r["query"], phases)
                           .startswith(("BEGIN", "COMMIT", "ROLLBACK", "the pool", "the driver"))]
                    show(top, payments, phases, f"{variant}: each statement's cost a call, {payments} payments one "
                         "after another (pg_stat_statements; times are under auto_explain's instrumentation)", False)
                    show([r for r in counted if not r["toplevel"]], payments, phases,
                         f"{variant}: inside those, run by a function or a trigger (already counted above)", False)
                    for r in top:
                        if r["plans"]:
                            console.print(f"  {phase_of(r['query'], phases)}: planned {r['plans'] / r['calls']:.2f} "
                                          f"times a call, {r['mean_plan_time']:.3f} ms a plan", highlight=False)
                    console.print(f"{variant}: per payment, its statements touched "
                                  f"{sum(r['shared_blks_hit'] + r['shared_blks_read'] for r in top) / payments:.1f} "
                                  f"shared blocks and wrote {sum(float(r['wal_bytes']) for r in top) / payments:,.0f} "
                                  "WAL bytes", highlight=False)
                    if tree:
                        for name, runs in measured.items():
                            e = runs[-1]
                            console.print(f"[bold]{variant}: {name}[/] ({e.ms:.3f} ms under auto_explain); "
                                          f"triggers a payment: {triggers_fired(runs, payments)}", highlight=False)
                            for line in node_lines(e.plan):
                                console.print("    " + line, highlight=False, markup=False)
                if json_out:
                    json_out.write_text(json.dumps(everything, indent=1, default=str))
    except NoFigure as exc:
        console.print(f"[bold red]NO FIGURE: {exc}[/]")
        raise typer.Exit(1) from None


if __name__ == "__main__":
    typer.run(main)
