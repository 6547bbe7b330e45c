"""Figures the machine's noise does not move: the API's instructions per payment, the database's cost per statement.

    .venv/bin/python -m bench.instructions [--in-process] [--low 10] [--high 30] [--replays 20] [--repeats 2]
        [--statements 200] [--jobs 4] [--idle 20,80] [--skip-callgrind] [--show-sql]

Not on a request's path: a bench of its own, beside `make bench` (whose
payments/s and CPU seconds move with whatever else the shared machine runs).

The API's instructions
    `payments api` (and the naive twin's `naive-twin`), one process, started
    as the bench starts them but under `valgrind --tool=callgrind`, against
    the fake PSP and rail (processes of their own, not counted) and a real
    PostgreSQL. This process is the client, outside valgrind, so the figure
    is the API's alone: uvicorn, the framework, validation, SQLAlchemy,
    asyncpg, the rail clients, metrics and logs. Payments are sent one after
    another (no concurrency, so the event loop does the same work each time).
    Callgrind counts the whole process, start-up and imports included, so
    each variant runs twice, with `low` and with `high` payments, and
    (Ir(high) - Ir(low)) / (high - low) cancels everything the two share.
    Replays likewise: `low` payments then `replays` retries of them, against
    `low` payments alone. What is left that is not the payment's own work:
    the timers that run by the clock (uvicorn's tick, the metrics flush),
    which under valgrind's slowdown run more often per payment than they do
    natively. The counts are not yet steady from run to run, in either
    mode below: something in a run moves by about a hundred million
    instructions, not yet found (docs/reference/performance.md).

    --in-process: instead, the app itself (create_app) in the measured
    process, driven through its ASGI interface by httpx, with no server
    around it: no readiness polls, no uvicorn tick, no /metrics thread. The
    client's work is in the count (the same for both variants); uvicorn's
    HTTP parsing is not.

The database's cost per statement
    pg_stat_statements, on a PostgreSQL server of this bench's own (the
    embedded one, in a data directory of its own on a free port, started
    with `shared_preload_libraries`; `make run`'s and the tests' servers are
    not touched). After a warm-up, the statistics are reset, a fixed number
    of payments is sent (at native speed: the API is not under valgrind
    here), and each of the service database's statements is printed per
    payment and per call, named by the phase it belongs to.

A run that cannot produce a figure (no valgrind, callgrind writing no
total, a request not answered as expected, pg_stat_statements not loaded)
says so and exits 1: it never prints a zero.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx
import typer
from rich.console import Console
from rich.table import Table

from bench.system import (
    LOGS,
    NAIVE,
    PHASED,
    RAILS_DATABASE,
    RESULTS,
    SERVICE_DATABASE,
    SETTINGS,
    console,
    fakes,
    running,
)
from devtools import bodies, embedded_db
from devtools.processes import NotHealthy, Process, free_port
from devtools.system import System

OUT = RESULTS / "callgrind"
# track=all: the statements inside claim_idempotency_key and the triggers are counted too, apart from (and
# also inside) the statement that ran them.
PRELOAD = (("shared_preload_libraries", "pg_stat_statements"), ("pg_stat_statements.track", "all"))
COMMAND = {PHASED: "api", NAIVE: "naive-twin"}
# Under valgrind, Python starts many times slower than natively, more so on a busy machine.
VALGRIND_START_SECONDS = 900
VALGRIND_STOP_SECONDS = 300
# The statements' table is wider than the bench's other tables: in a log, 150 columns.
wide = Console(width=None if sys.stdout.isatty() else 150)


class NoFigure(Exception):
    """This run cannot produce the figure it was asked for; the message says why."""


# --- The pure parts: tests/tooling/test_bench_instructions.py -----------------

_TOTALS = re.compile(r"^totals:\s+(\d+)", re.MULTILINE)
_SUMMARY = re.compile(r"^summary:\s+(\d+)", re.MULTILINE)


def callgrind_total(text: str) -> int:
    """The instructions (Ir) a callgrind output file counts in all: its `totals:` line (what valgrind prints as
    "I refs"), else its `summary:` line."""
    found = _TOTALS.search(text) or _SUMMARY.search(text)
    if found is None:
        raise NoFigure("callgrind's output has no summary: or totals: line")
    total = int(found.group(1))
    if total <= 0:
        raise NoFigure(f"callgrind counted {total} instructions")
    return total


@dataclass(frozen=True)
class Count:
    """One callgrind run of the API: what it was sent, and the instructions it executed in all."""

    payments: int
    replays: int
    instructions: int
    seconds: float = 0.0  # wall time from the API answering /healthz to its being told to stop


def per_unit(fewer: Count, more: Count) -> float:
    """Instructions per payment (or per replay): the difference of two runs that differ in that one thing.

    Start-up, imports and shutdown are in both, and cancel.
    """
    payments, replays = more.payments - fewer.payments, more.replays - fewer.replays
    if (payments > 0) == (replays > 0) or min(payments, replays) < 0:
        raise NoFigure(f"runs {fewer} and {more} differ in more (or less) than one kind of request")
    extra = more.instructions - fewer.instructions
    if extra <= 0:
        raise NoFigure(f"the run with more requests counted no more instructions ({fewer.instructions} → "
                       f"{more.instructions}): no figure")
    return extra / (payments or replays)


def spread(figures: Iterable[float]) -> float:
    """(largest - smallest) / smallest: how far repeated figures disagree."""
    figures = list(figures)
    return (max(figures) - min(figures)) / min(figures)


_LITERAL = re.compile(r"'(?:[^']|'')*'")
_PARAMETER = re.compile(r"(?<![:\w]):\w+|\$\d+")
_NUMBER = re.compile(r"\b\d+\b")


def normalise(sql: str) -> str:
    """A statement's text with every parameter and constant as `?`, whitespace collapsed, in lower case.

    pg_stat_statements shows `$1` where SQLAlchemy's text had `:name` (and
    where a constant was written inline); both become the same `?`.
    """
    sql = _LITERAL.sub("?", sql)
    sql = _PARAMETER.sub("?", sql)
    sql = _NUMBER.sub("?", sql)
    return " ".join(sql.replace("(", " ( ").replace(")", " ) ").replace(",", " , ").split()).lower()


# Statements that are not a phase's, by what their text says, in order: the
# first that matches names it.
OTHER_STATEMENTS = (
    ("naive.payment", "naive twin: payment"),
    ("naive.ledger_entry", "naive twin: ledger"),
    ("caller_id", "the caller's and the key's lookup"),
    ("insert into idempotency_key", "the claim: the key row's insert"),
    ("pg_advisory_xact_lock", "the claim: the key's advisory lock"),
    ("select ? from idempotency_key", "the claim: is the key taken?"),
    ('"public"."payment" x where', "foreign key: the payment row KEY SHARE"),
    ('"public"."client" x where', "foreign key: the client row KEY SHARE"),
    ("api_key", "the caller's lookup (API key)"),
    ("from client", "the caller's lookup (client)"),
    ("idempotency_key", "the key's lookup"),
    ("begin", "BEGIN"),
    ("commit", "COMMIT"),
    ("rollback", "ROLLBACK"),
    ("pg_", "the driver or pool (catalogue)"),
    ("select ?", "the pool's ping"),
)


def phase_of(query: str, phases: dict[str, str]) -> str:
    """The phase a pg_stat_statements query belongs to: exactly one of `phases` (normalised text → name), else
    the first of OTHER_STATEMENTS its text contains, else "other"."""
    text = normalise(query)
    if text in phases:
        return phases[text]
    for needle, name in OTHER_STATEMENTS:
        if needle in text:
            return name
    return "other"


def known_phases() -> dict[str, str]:
    """Every phase statement's normalised text → its name (HANDLER1, CHARGE_CAPTURED, ...), the twin's too."""
    from sqlalchemy.sql.elements import TextClause

    from app.machine.statements import Statement
    from app.payments import phases, returns
    from app.payments.refunds import phases as refund_phases
    from naive_twin import app as naive

    found = {}
    for module in (phases, returns, refund_phases):
        for name, value in vars(module).items():
            if isinstance(value, Statement):
                found[normalise(value.sql)] = name
    for name, value in vars(naive).items():
        if isinstance(value, TextClause):
            found[normalise(value.text)] = f"naive twin {name.strip('_')}"
    return found


# --- The API under callgrind --------------------------------------------------


@dataclass(frozen=True)
class Stack:
    """What the API processes are started against."""

    system: System  # on the service's database, with the fakes
    api_key: str


def require_valgrind() -> str:
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise NoFigure("valgrind is not installed (apt-get install valgrind): no instruction counts")
    return valgrind


IN_PROCESS = False  # main's --in-process: the app driven in the measured process, with no server around it


def count(stack: Stack, variant: str, payments: int, replays: int, tag: str, idle: float = 0.0) -> Count:
    """One run of `variant`'s API under callgrind: started, sent `payments` new payments then `replays`
    retries of them, left idle `idle` seconds, stopped; the instructions it executed in all."""
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"{variant}-{payments}p-{replays}r-{tag}.out"
    out.unlink(missing_ok=True)
    process = stack.system.api_process(f"callgrind-{variant}", command=COMMAND[variant], **SETTINGS[variant])
    # The same hash seed every run: set and dict order, and so the work, do not vary from run to run.
    process.env["PYTHONHASHSEED"] = "0"
    if IN_PROCESS:
        process.argv = [sys.executable, "-m", "bench.instructions", "--drive", variant, str(payments), str(replays)]
        process.env["BENCH_API_KEY"] = stack.api_key
        process.port = None  # not a server: it drives itself, and exits
    process.argv = [require_valgrind(), "--tool=callgrind", f"--callgrind-out-file={out}", *process.argv]
    process.log = LOGS / f"callgrind-{out.stem}.log"
    process.log.unlink(missing_ok=True)
    process.timeout, process.grace = VALGRIND_START_SECONDS, VALGRIND_STOP_SECONDS
    try:
        process.start()
    except NotHealthy as exc:
        raise NoFigure(f"{variant} API under callgrind did not start: {exc}") from None
    up = time.monotonic()
    try:
        if IN_PROCESS:
            process.popen.wait(VALGRIND_START_SECONDS)
        else:
            send(process.url, stack.api_key, payments, replays, replayed=variant == PHASED)
            time.sleep(idle)  # the idle measurement: what the API's timers cost by the second
        seconds = time.monotonic() - up
    finally:
        process.stop()
    # uvicorn, once shut down cleanly, raises the SIGTERM again to exit by it.
    if process.popen.returncode not in (0, -signal.SIGTERM):
        raise NoFigure(f"{variant} API under callgrind exited with {process.popen.returncode}; see {process.log}")
    if not out.exists():
        raise NoFigure(f"callgrind wrote no {out}; see {process.log}")
    return Count(payments, replays, callgrind_total(out.read_text(errors="replace")), seconds)


def send(url: str, api_key: str, payments: int, replays: int, *, replayed: bool) -> None:
    """`payments` new payments, one after another, then `replays` retries of the first of them; anything but
    the expected answer stops the run."""
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    sent = []
    with httpx.Client(base_url=url, headers=headers, timeout=300) as client:
        for _ in range(payments):
            key = str(uuid.uuid4())
            body = json.dumps(bodies.payment_body()).encode()
            response = client.post("/v1/payments", content=body, headers={"Idempotency-Key": key})
            if response.status_code != 201:
                raise NoFigure(f"a new payment was answered {response.status_code}: {response.text[:300]}")
            sent.append((key, body))
        for i in range(replays):
            key, body = sent[i % len(sent)]
            response = client.post("/v1/payments", content=body, headers={"Idempotency-Key": key})
            if response.status_code != 201 or (replayed and response.headers.get("Idempotent-Replayed") != "true"):
                raise NoFigure(f"a replay was answered {response.status_code} "
                               f"(Idempotent-Replayed: {response.headers.get('Idempotent-Replayed')})")


@dataclass(frozen=True)
class Instructions:
    variant: str
    repeat: int
    per_payment: float
    per_replay: float | None


def instructions(stack: Stack, chosen: list[str], low: int, high: int, replays: int, repeats: int,
                 jobs: int) -> list[Instructions]:
    """Every variant's callgrind runs (`repeats` times each), `jobs` at a time; the figures they give."""
    runs = [(variant, payments, retries, repeat) for repeat in range(1, repeats + 1) for variant in chosen
            for payments, retries in ((low, 0), (high, 0), *(((low, replays),) if variant == PHASED and replays else ()))]

    def one(run: tuple[str, int, int, int]) -> Count:
        variant, payments, retries, repeat = run
        started = time.monotonic()
        result = count(stack, variant, payments, retries, f"r{repeat}")
        console.print(f"{variant} repeat {repeat}: {payments} payments, {retries} replays: Ir {result.instructions:,} "
                      f"[{time.monotonic() - started:.0f} s, {result.seconds:.0f} s up]")
        return result

    console.print(f"{len(runs)} callgrind runs, {jobs} at a time")
    pool = ThreadPoolExecutor(jobs)
    try:
        counts = dict(zip(runs, pool.map(one, runs)))
    finally:
        # On a failure or ^C the runs not yet started are dropped, not run to the end.
        pool.shutdown(cancel_futures=True)
    figures = []
    for repeat in range(1, repeats + 1):
        for variant in chosen:
            fewer, more = counts[(variant, low, 0, repeat)], counts[(variant, high, 0, repeat)]
            retried = counts.get((variant, low, replays, repeat))
            figures.append(Instructions(variant, repeat, per_unit(fewer, more),
                                        per_unit(fewer, retried) if retried else None))
    return figures


def drive(variant: str, payments: int, replays: int) -> None:
    """--in-process: the app itself (create_app) driven by httpx through its ASGI interface, in this process,
    with its lifespan, logging and metrics as `payments api` sets them up, and no server: no uvicorn tick
    and no /metrics thread, whose work goes by the clock and not by the payment. The client's own work is in
    the count, the same for both variants; uvicorn's HTTP parsing is not."""
    import uvloop

    from app.config import Settings
    from app.observability import logs, multiproc

    settings = Settings()
    made = None
    if variant == PHASED and settings.metrics_enabled:
        path, fresh = multiproc.prepare()
        made = path if fresh else None
    logs.configure(settings.log_format, settings.log_level)
    if variant == PHASED:
        from app.main import create_app
    else:
        from naive_twin.app import create_app
    app = create_app(settings)

    async def run() -> None:
        headers = {"Authorization": f"Bearer {os.environ['BENCH_API_KEY']}", "Content-Type": "application/json"}
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://api", headers=headers, timeout=300) as client:
            sent = []
            for _ in range(payments):
                key, body = str(uuid.uuid4()), json.dumps(bodies.payment_body()).encode()
                response = await client.post("/v1/payments", content=body, headers={"Idempotency-Key": key})
                if response.status_code != 201:
                    raise NoFigure(f"a new payment was answered {response.status_code}: {response.text[:300]}")
                sent.append((key, body))
            for i in range(replays):
                key, body = sent[i % len(sent)]
                response = await client.post("/v1/payments", content=body, headers={"Idempotency-Key": key})
                if response.status_code != 201 or response.headers.get("Idempotent-Replayed") != "true":
                    raise NoFigure(f"a replay was answered {response.status_code}")

    try:
        uvloop.install()
        asyncio.run(run())
    finally:
        if made is not None:
            multiproc.remove(made)


# --- The database's cost per statement ---------------------------------------


STATEMENTS_SQL = """
SELECT s.query, s.calls, s.total_exec_time, s.mean_exec_time, s.rows,
       s.shared_blks_hit, s.shared_blks_read, s.shared_blks_dirtied, s.shared_blks_written,
       s.wal_bytes, s.wal_records, s.toplevel
  FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
 WHERE d.datname = $1
 ORDER BY s.total_exec_time DESC
"""


async def _require_statements(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        preloaded = await conn.fetchval("SELECT current_setting('shared_preload_libraries')")
        if "pg_stat_statements" not in preloaded:
            raise NoFigure(f"pg_stat_statements is not in shared_preload_libraries ({preloaded!r}) on this server: "
                           "no statement costs")
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        await conn.fetchval("SELECT count(*) FROM pg_stat_statements")
    except asyncpg.PostgresError as exc:
        raise NoFigure(f"pg_stat_statements cannot be used: {exc}") from None
    finally:
        await conn.close()


async def _reset(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("SELECT pg_stat_statements_reset()")
    finally:
        await conn.close()


async def _read(url: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetch(STATEMENTS_SQL, SERVICE_DATABASE)
    finally:
        await conn.close()


def statement_costs(stack: Stack, server_url: str, variant: str, payments: int, warmup: int, top: int,
                    show_sql: bool = False) -> None:
    """`payments` new payments to `variant`'s API (natively), after `warmup`; its statements, top by time."""
    process = stack.system.api_process(f"statements-{variant}", command=COMMAND[variant], **SETTINGS[variant])
    process.log = LOGS / f"statements-{variant}.log"
    process.log.unlink(missing_ok=True)
    process.start()
    try:
        send(process.url, stack.api_key, warmup, 0, replayed=False)
        asyncio.run(_reset(server_url))
        send(process.url, stack.api_key, payments, 0, replayed=False)
        rows = asyncio.run(_read(server_url))
    finally:
        process.stop()
    if not rows:
        raise NoFigure("pg_stat_statements recorded no statement in the service's database")
    phases = known_phases()
    ran = [r for r in rows if r["toplevel"]]
    inside = [r for r in rows if not r["toplevel"]]
    show(ran[:top], payments, phases, f"{variant}: the database's cost per statement, {payments} payments one after "
         f"another (top {top} by total time)", show_sql)
    total_time = sum(r["total_exec_time"] for r in ran)
    wal = sum(float(r["wal_bytes"]) for r in ran)
    console.print(f"{variant}: all {len(ran)} statements: {total_time / payments:.3f} ms of execution, "
                  f"{wal / payments:,.0f} WAL bytes, "
                  f"{sum(r['shared_blks_hit'] + r['shared_blks_read'] for r in ran) / payments:.1f} shared blocks "
                  f"touched per payment")
    if inside:
        show(inside[:top], payments, phases, f"{variant}: inside those, run by a function or a trigger "
             "(already counted in the statement that ran them)", show_sql)


def show(rows: list[asyncpg.Record], payments: int, phases: dict[str, str], title: str, show_sql: bool) -> None:
    table = Table(title=title, title_justify="left")
    for column in ("statement", "calls/payment", "mean ms", "hit/call", "read/call", "dirtied/call",
                   "written/call", "WAL B/call", "WAL rec/call", "rows/call"):
        table.add_column(column, justify="left" if column == "statement" else "right")
    for r in rows:
        calls = r["calls"]
        table.add_row(phase_of(r["query"], phases), f"{calls / payments:.2f}", f"{r['mean_exec_time']:.3f}",
                      *(f"{r[c] / calls:.1f}" for c in ("shared_blks_hit", "shared_blks_read", "shared_blks_dirtied",
                                                        "shared_blks_written")),
                      f"{float(r['wal_bytes']) / calls:.0f}", f"{r['wal_records'] / calls:.1f}",
                      f"{r['rows'] / calls:.2f}")
    wide.print(table)
    for r in rows:
        name = phase_of(r["query"], phases)
        if show_sql or name == "other":
            console.print(f"  {name}: {' '.join(r['query'].split())[:300]}", soft_wrap=True, markup=False)


# --- The run ------------------------------------------------------------------


@contextmanager
def bench_server(system: System) -> Iterator[str]:
    """DATABASE_URL's server, else an embedded server of this bench's own, with pg_stat_statements preloaded;
    the maintenance database's URL."""
    if os.environ.get("DATABASE_URL"):
        postgres = system.start_postgres()
    else:
        root = Path(os.environ.get("PAYMENTS_DATA_DIR", Path.cwd() / ".data")).resolve()
        server = embedded_db.EmbeddedServer(root / "postgres-instructions", free_port(), settings=PRELOAD)
        with console.status("starting an embedded PostgreSQL of the bench's own"):
            postgres = system.start_postgres(server)
        console.print(f"PostgreSQL (embedded, {server.data_dir}) on port {server.port}, pg_stat_statements preloaded")
    yield postgres.url


def main(
    low: int = typer.Option(10, min=1, help="Payments in the shorter callgrind run."),
    high: int = typer.Option(30, min=2, help="Payments in the longer callgrind run."),
    replays: int = typer.Option(20, min=0, help="Replays (phased only) added to the shorter run; 0: none."),
    repeats: int = typer.Option(2, min=1, help="Times every callgrind figure is measured."),
    statements: int = typer.Option(200, min=0, help="Payments for pg_stat_statements; 0: skip it."),
    warmup: int = typer.Option(20, min=0, help="Payments before pg_stat_statements is reset."),
    top: int = typer.Option(10, min=1, help="Statements shown, by total time."),
    variants: str = typer.Option(f"{PHASED},{NAIVE}", help="phased, naive or both."),
    skip_callgrind: bool = typer.Option(False, "--skip-callgrind", help="Only the database's cost per statement."),
    show_sql: bool = typer.Option(False, "--show-sql", help="Print each shown statement's text."),
    jobs: int = typer.Option(1, min=1, help="Callgrind runs at a time (each is one process, one CPU)."),
    in_process: bool = typer.Option(False, "--in-process", help="Drive the app in the measured process "
                                    "(no server, no clock-driven timers) instead of `payments api` from outside."),
    idle: str = typer.Option("", help="Instead: the API's instructions per idle second, from two runs with no "
                             "payments left idle this long, e.g. 20,80."),
) -> None:
    """The API's instructions per payment under callgrind, and the database's cost per statement."""
    global IN_PROCESS
    IN_PROCESS = in_process
    chosen = [v.strip() for v in variants.split(",") if v.strip()]
    if not chosen or set(chosen) - set(COMMAND) or high <= low:
        raise typer.BadParameter("--variants is phased, naive or both; --high must exceed --low")
    try:
        if not skip_callgrind:
            console.print(subprocess.run([require_valgrind(), "--version"], capture_output=True, text=True).stdout.strip())
        with System(LOGS) as system, bench_server(system) as server_url:
            asyncio.run(_require_statements(server_url)) if statements else None
            system.create_database(RAILS_DATABASE, migrate=False)
            system.create_database(SERVICE_DATABASE)
            _, api_key = system.create_client("bench")
            rails_url = system.postgres.database_url(RAILS_DATABASE)
            with running(fakes(rails_url)) as (psp, rail):
                system.psp, system.rail = psp, rail
                stack = Stack(system, api_key)
                if statements:
                    for variant in chosen:
                        statement_costs(stack, server_url, variant, statements, warmup, top, show_sql)
                if idle:
                    idle_rate(stack, chosen, [float(x) for x in idle.split(",")], jobs)
                elif not skip_callgrind:
                    figures = instructions(stack, chosen, low, high, replays, repeats, jobs)
                    report(figures, chosen, low, high)
    except NoFigure as exc:
        console.print(f"[bold red]NO FIGURE: {exc}[/]")
        raise typer.Exit(1) from None


def idle_rate(stack: Stack, chosen: list[str], seconds: list[float], jobs: int) -> None:
    """Instructions per second of an idle API (its timers: uvicorn's tick, the metrics' thread): two runs
    with no payments, idle for different times."""
    runs = [(variant, s) for variant in chosen for s in seconds]
    pool = ThreadPoolExecutor(jobs)
    try:
        counts = dict(zip(runs, pool.map(lambda run: count(stack, run[0], 0, 0, f"idle{run[1]:.0f}", run[1]), runs)))
    finally:
        pool.shutdown(cancel_futures=True)
    for variant in chosen:
        shorter, longer = counts[(variant, min(seconds))], counts[(variant, max(seconds))]
        extra = longer.instructions - shorter.instructions
        if extra <= 0:
            raise NoFigure(f"{variant}: idle longer, no more instructions ({shorter} → {longer})")
        console.print(f"{variant} idle: Ir {shorter.instructions:,} ({shorter.seconds:.1f} s up), "
                      f"{longer.instructions:,} ({longer.seconds:.1f} s up) → "
                      f"{extra / (longer.seconds - shorter.seconds):,.0f} per idle second")


def report(figures: list[Instructions], chosen: list[str], low: int, high: int) -> None:
    table = Table(title=f"The API's instructions (callgrind Ir), ({high} - {low}) payments one after another")
    table.add_column("variant")
    table.add_column("repeat", justify="right")
    table.add_column("Ir per payment", justify="right")
    table.add_column("Ir per replay", justify="right")
    for f in figures:
        table.add_row(f.variant, str(f.repeat), f"{f.per_payment:,.0f}",
                      "" if f.per_replay is None else f"{f.per_replay:,.0f}")
    wide.print(table)
    for variant in chosen:
        mine = [f.per_payment for f in figures if f.variant == variant]
        if len(mine) > 1:
            console.print(f"{variant}: repeats agree within {spread(mine):.2%}")
    if set(chosen) == {PHASED, NAIVE}:
        for repeat in sorted({f.repeat for f in figures}):
            by = {f.variant: f.per_payment for f in figures if f.repeat == repeat}
            console.print(f"repeat {repeat}: phased ÷ naive in instructions per payment = {by[PHASED] / by[NAIVE]:.3f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--drive"]:
        drive(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        typer.run(main)
