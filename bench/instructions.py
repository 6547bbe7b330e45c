"""Figures the machine's noise does not move: the app's instructions per payment, the database's cost per statement.

    .venv/bin/python -m bench.instructions [--variants phased,naive] [--low 10] [--high 110] [--no-replays]
        [--warmup 10] [--repeats 2] [--tolerance 0.01] [--statements 200] [--jobs 4] [--skip-callgrind]
        [--show-sql] [--greenlets]

Not on a request's path: a bench of its own, beside `make bench` (whose
payments/s and CPU seconds move with whatever else the shared machine runs).

The app's instructions
    One process under `valgrind --tool=callgrind` (this module's `--drive`)
    holds the app: the phased service's create_app, or the naive twin's,
    with its lifespan, logging and metrics set up as `payments api` sets
    them up, against the fake PSP and rail (processes of their own, not
    counted) and a real PostgreSQL. It sends itself requests one after
    another straight through the app's ASGI interface, as a server hands
    them over: no server, no HTTP client, no readiness polls, no timers of
    a server's. So the count is the app's: the framework, validation,
    SQLAlchemy, asyncpg, the rail clients (their HTTP client included),
    metrics and logs; not uvicorn's HTTP parsing.
    Callgrind counts only windows: its counts are zeroed as a window starts
    and written to a file of their own as it ends (MARKERS), so start-up,
    imports and warm-up, which vary from run to run by far more than a
    payment costs, are never in a figure. Before each window a warm-up has
    run every path, the garbage collector has run and frozen what survived,
    and the metrics' batches are written. Each run counts a window of `low`
    payments and one of `high`, and (Ir(high) - Ir(low)) / (high - low) is
    the figure per payment; replays likewise. The calls to the fakes get
    timeouts a valgrind-slowed run cannot reach (PATIENT), so no call is
    retried, and their connections are kept open (KEEP_ALIVE_SECONDS), so
    none is made again.
    Every variant runs `repeats` times, and a figure is given only if its
    repeats agree within `tolerance`. The variants: `phased` (the safe
    service as `payments api` runs it, metrics and logs on), `naive` (the
    twin) and `unwatched` (the safe service with metrics and logs off, as
    `make bench` judges watching), so phased ÷ unwatched is what watching
    costs in the app's own instructions.

The greenlets started per payment (--greenlets)
    SQLAlchemy runs each of its awaits in a new greenlet, and on this
    Python each greenlet maps a stack of its own for Python's frames as it
    starts and unmaps it as it ends: system calls and page faults, which
    callgrind does not count. So the same windows run once more, natively,
    and count the greenlets started in each (greenlet.settrace: a Python call
    on every switch, which would be in an instruction count).

The database's cost per statement
    pg_stat_statements, on a PostgreSQL server of this bench's own (the
    embedded one, in a data directory of its own on a free port, started
    with `shared_preload_libraries`; `make run`'s and the tests' servers are
    not touched). After a warm-up, the statistics are reset, a fixed number
    of payments is sent to `payments api` (or `naive-twin`) at native speed,
    and each of the service database's statements is printed per payment
    and per call, named by the phase it belongs to.

A run that cannot produce a figure (no valgrind, no window's dump from
callgrind, repeats that disagree, a request not answered as expected,
pg_stat_statements not loaded) says NO FIGURE and why, and exits 1: it never
prints a zero.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
import weakref
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
    UNWATCHED,
    Service,
    console,
    fakes,
    running,
)
from devtools import bodies, embedded_db
from devtools.processes import NotHealthy, free_port
from devtools.system import System

OUT = Path(os.environ.get("BENCH_CALLGRIND_DIR", RESULTS / "callgrind"))
# track=all: the statements inside claim_idempotency_key and the triggers are counted too, apart from (and
# also inside) the statement that ran them.
PRELOAD = (("shared_preload_libraries", "pg_stat_statements"), ("pg_stat_statements.track", "all"))
COMMAND = {PHASED: "api", UNWATCHED: "api", NAIVE: "naive-twin"}
# The safe service with metrics and logs (PHASED, the defaults) or without
# (UNWATCHED: bench/system.py's SETTINGS); the twin has neither replays nor
# the safe service's metrics.
SAFE = (PHASED, UNWATCHED)
# Under valgrind, Python runs many times slower than natively, more so on a busy machine.
VALGRIND_SECONDS = 3600
VALGRIND_STOP_SECONDS = 300
# Under valgrind a call to the PSP or the rail can wait past its 5 s timeout; the gateway would then retry it
# (and the count would hold two calls). The measured process waits as long as a call takes instead.
PATIENT = {"PSP_TIMEOUT_SECONDS": "600", "RAIL_TIMEOUT_SECONDS": "600"}
# How long an idle keep-alive connection between the app and the fakes stays open, at both ends. Natively 5 s
# (uvicorn's default, httpx's), far more than the gap between two payments; under valgrind's slowdown on a
# busy machine the gap can pass it, and the app's next call then reconnects (work a window would count or not,
# by the clock) or is written to a connection the fake has just closed (a payment retried, the twin's 502).
KEEP_ALIVE_SECONDS = 3600
# The window callgrind counts: its counts are zeroed on entering the first function and written to a file of
# their own on leaving the second (--dump-after), so start-up, warm-up and exit are left out. Two builtins
# nothing else in the process calls (`drive` calls them around each window); CPython's C functions, so they
# need a Python whose symbols are not stripped (without them, no dumps, and the run says so).
MARKERS = ("--zero-before=sys_getallocatedblocks", "--dump-after=gc_get_freeze_count")
DUMPED_BY = "desc: Trigger: --dump-after=gc_get_freeze_count"
# Where `drive` writes each window's count of greenlets started, when it is set (`greenlets_per_payment`).
GREENLETS_OUT = "BENCH_GREENLETS_OUT"
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


def window_total(text: str) -> int:
    """The instructions of one window: the `summary:` of a callgrind dump written on leaving the window's end
    marker (what callgrind counted since it zeroed its counts), else no figure.

    Not the dump's `totals:` (the sum of its cost lines): the first dump's also holds, once, tens of millions
    of instructions from before the first zeroing. A dump at the program's end counts start-up too."""
    if DUMPED_BY not in text.splitlines():
        raise NoFigure(f"a callgrind dump was not written by the window's end marker ({DUMPED_BY!r} missing)")
    found = _SUMMARY.search(text)
    if found is None or int(found.group(1)) <= 0:
        raise NoFigure("a window's callgrind dump has no summary: line, or counted nothing")
    return int(found.group(1))


@dataclass(frozen=True)
class Count:
    """One window of the measured process: what it was sent, and the instructions it executed."""

    payments: int
    replays: int
    instructions: int


def per_unit(fewer: Count, more: Count) -> float:
    """Instructions per payment (or per replay): the difference of two windows that differ in that one thing.

    What every window holds besides its requests (the markers, the metrics' one write) is in both, and cancels.
    """
    payments, replays = more.payments - fewer.payments, more.replays - fewer.replays
    if (payments > 0) == (replays > 0) or min(payments, replays) < 0:
        raise NoFigure(f"windows {fewer} and {more} differ in more (or less) than one kind of request")
    extra = more.instructions - fewer.instructions
    if extra <= 0:
        raise NoFigure(f"the window with more requests counted no more instructions ({fewer.instructions} → "
                       f"{more.instructions}): no figure")
    return extra / (payments or replays)


def spread(figures: Iterable[float]) -> float:
    """(largest - smallest) / smallest: how far repeated figures disagree."""
    figures = list(figures)
    return (max(figures) - min(figures)) / min(figures)


def agreed(name: str, figures: list[float], tolerance: float) -> float:
    """The repeats' mean, if they agree within `tolerance` (a fraction); else no figure."""
    if len(figures) < 2:
        raise NoFigure(f"{name}: one repeat cannot show that the figure repeats (--repeats 2 or more)")
    if spread(figures) > tolerance:
        raise NoFigure(f"{name}: the repeats disagree by {spread(figures):.2%} "
                       f"({', '.join(f'{f:,.0f}' for f in figures)}), more than {tolerance:.1%}")
    return sum(figures) / len(figures)


# A comment's text is not the statement's: PostgreSQL may leave a leading one
# out of what pg_stat_statements keeps, and an apostrophe in one ("the
# cursor's row") would otherwise open a literal.
_COMMENT = re.compile(r"--[^\n]*")
_LITERAL = re.compile(r"'(?:[^']|'')*'")
_PARAMETER = re.compile(r"(?<![:\w]):\w+|\$\d+")
_NUMBER = re.compile(r"\b\d+\b")
# A NULL written as a value (`SET lease_token = NULL`) is a constant too, which
# pg_stat_statements may show as `$n`; so every NULL reads as one.
_NULL = re.compile(r"\bnull\b", re.I)


def normalise(sql: str) -> str:
    """A statement's text without its comments, every parameter and constant as `?`, whitespace collapsed, lower case.

    pg_stat_statements shows `$1` where SQLAlchemy's text had `:name` (and
    where a constant was written inline); both become the same `?`.
    """
    sql = _COMMENT.sub("", sql)
    sql = _LITERAL.sub("?", sql)
    sql = _PARAMETER.sub("?", sql)
    sql = _NUMBER.sub("?", sql)
    sql = _NULL.sub("?", sql)
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


@dataclass(frozen=True)
class Window:
    """A stretch of the measured process counted on its own: `requests` new payments, or replays of them."""

    kind: str  # PAYMENTS or REPLAYS
    requests: int


PAYMENTS, REPLAYS = "payments", "replays"


def windows(variant: str, low: int, high: int, replays: bool) -> list[Window]:
    """The windows one callgrind run of `variant` counts, in order: `low` then `high` new payments, then (the
    safe service only, watched or not: the twin has no replays) `low` then `high` replays."""
    kinds = (PAYMENTS, REPLAYS) if variant in SAFE and replays else (PAYMENTS,)
    return [Window(kind, n) for kind in kinds for n in (low, high)]


def drive_argv(variant: str, warmup: int, plan: list[Window]) -> list[str]:
    """The command of this module's `--drive` for `variant`, its warm-up and its windows."""
    return [sys.executable, "-m", "bench.instructions", "--drive", variant, str(warmup),
            ",".join(f"{w.kind}:{w.requests}" for w in plan)]


def count(stack: Stack, variant: str, plan: list[Window], warmup: int, tag: str) -> list[int]:
    """One run of `variant`'s app under callgrind (this module's `--drive`): started, warmed up, then every
    window of `plan` counted on its own; the instructions each window executed."""
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"{variant}-{tag}.out"
    for old in OUT.glob(f"{out.name}*"):
        old.unlink()
    process = stack.system.api_process(f"callgrind-{variant}", command=COMMAND[variant],
                                       **SETTINGS[variant], **PATIENT)
    # The same hash seed every run: set and dict order, and so the work, do not vary from run to run.
    process.env["PYTHONHASHSEED"] = "0"
    process.env["BENCH_API_KEY"] = stack.api_key
    process.argv = [require_valgrind(), "--tool=callgrind", f"--callgrind-out-file={out}", *MARKERS,
                    *drive_argv(variant, warmup, plan)]
    process.port = None  # not a server: it drives itself, and exits
    process.log = LOGS / f"callgrind-{out.stem}.log"
    process.log.unlink(missing_ok=True)
    process.timeout, process.grace = VALGRIND_SECONDS, VALGRIND_STOP_SECONDS
    try:
        process.start()
    except NotHealthy as exc:
        raise NoFigure(f"{variant} under callgrind did not start: {exc}") from None
    try:
        process.popen.wait(VALGRIND_SECONDS)
    except subprocess.TimeoutExpired:
        raise NoFigure(f"{variant} under callgrind did not finish within {VALGRIND_SECONDS} s; see {process.log}") from None
    finally:
        process.stop()
    if process.popen.returncode != 0:
        raise NoFigure(f"{variant} under callgrind exited with {process.popen.returncode}; see {process.log}")
    # Callgrind writes one file per dump, `out.1`, `out.2`, ..., and `out` itself at exit (start-up, warm-up
    # and the gaps between windows: not counted).
    parts = [out.with_name(f"{out.name}.{i}") for i in range(1, len(plan) + 2)]
    if not all(p.exists() for p in parts[:-1]) or parts[-1].exists():
        found = sorted(p.name for p in OUT.glob(f"{out.name}.*"))
        raise NoFigure(f"callgrind wrote the dumps {found}, not one per window ({len(plan)}): is "
                       f"{MARKERS} a function of this Python's (its symbols stripped)? see {process.log}")
    return [window_total(p.read_text(errors="replace")) for p in parts[:-1]]


def patient_fakes(rails_url: str) -> list[Service]:
    """The fake PSP and rail as the bench starts them, but keeping idle connections open KEEP_ALIVE_SECONDS."""
    services = fakes(rails_url)
    for service, kind in zip(services, ("psp", "rail"), strict=True):
        service.argv = [sys.executable, "-m", "bench.instructions", "--fake", kind, *service.argv[1:]]
    return services


def serve_fake(kind: str, args: list[str]) -> None:
    """`fake-psp` or `fake-rail` with `args`, its uvicorn keeping idle connections open KEEP_ALIVE_SECONDS."""
    import importlib

    import uvicorn

    from fake_rails import common

    def serve_app(app, host: str, port: int) -> None:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False,
                    timeout_keep_alive=KEEP_ALIVE_SECONDS)

    common.serve_app = serve_app
    sys.argv = [f"fake-{kind}", *args]
    importlib.import_module(f"fake_rails.{kind}").main()


def patient_http_client(original):
    """app.services' http_client, its idle connections kept KEEP_ALIVE_SECONDS (see KEEP_ALIVE_SECONDS)."""

    def http_client(**kwargs):
        client = original(**kwargs)
        limits = client._transport.limits  # httpx_aiohttp's transport: read when it opens its connector
        client._transport.limits = httpx.Limits(max_connections=limits.max_connections,
                                                max_keepalive_connections=limits.max_keepalive_connections,
                                                keepalive_expiry=KEEP_ALIVE_SECONDS)
        return client

    return http_client


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


def instructions(stack: Stack, chosen: list[str], low: int, high: int, replays: bool, repeats: int, warmup: int,
                 jobs: int) -> list[Instructions]:
    """Every variant's callgrind run (`repeats` times each), `jobs` at a time; the figures they give."""
    runs = [(variant, repeat) for repeat in range(1, repeats + 1) for variant in chosen]

    def one(run: tuple[str, int]) -> Instructions:
        variant, repeat = run
        plan = windows(variant, low, high, replays)
        started = time.monotonic()
        counted = dict(zip(plan, count(stack, variant, plan, warmup, f"r{repeat}")))
        console.print(f"{variant} repeat {repeat} [{time.monotonic() - started:.0f} s]: "
                      + ", ".join(f"{w.requests} {w.kind} Ir {ir:,}" for w, ir in counted.items()))

        def per(kind: str) -> float:
            fewer, more = (Count(*((n, 0) if kind == PAYMENTS else (0, n)), counted[Window(kind, n)])
                           for n in (low, high))
            return per_unit(fewer, more)

        return Instructions(variant, repeat, per(PAYMENTS), per(REPLAYS) if Window(REPLAYS, low) in counted else None)

    console.print(f"{len(runs)} callgrind runs, {jobs} at a time")
    pool = ThreadPoolExecutor(jobs)
    try:
        return list(pool.map(one, runs))
    finally:
        # On a failure or ^C the runs not yet started are dropped, not run to the end.
        pool.shutdown(cancel_futures=True)


def drive(variant: str, warmup: int, plan: list[Window]) -> None:
    """The measured process (under callgrind): `variant`'s app (create_app) with its lifespan, logging and
    metrics as `payments api` sets them up, sent requests straight through its ASGI interface, with no
    server and no HTTP client around it; each window of `plan` between the two MARKERS.

    Before every window the warm-up has already run each path once (imports, prepared statements, the pools'
    connections), a full garbage collection has run and frozen what survived it, and the metrics' batches
    are written; in the window they are written once, at its end, not by the clock (natively, one write
    covers a second's payments; under valgrind's slowdown the clock would write once a payment)."""
    import gc

    import greenlet
    import uvloop

    from app.config import Settings
    from app.observability import logs, multiproc

    settings = Settings()
    made = None
    if variant in SAFE and settings.metrics_enabled:
        path, fresh = multiproc.prepare()
        made = path if fresh else None
    logs.configure(settings.log_format, settings.log_level)
    if variant in SAFE:
        from app.main import create_app
    else:
        from naive_twin.app import create_app
    app = create_app(settings)
    from app import services  # these two after multiproc.prepare: they import prometheus_client
    from app.observability import metrics

    services.http_client = patient_http_client(services.http_client)  # read by the lifespan, below

    metrics.FLUSH_SECONDS = float(VALGRIND_SECONDS)  # only by the explicit flushes below
    headers = [(b"authorization", f"Bearer {os.environ['BENCH_API_KEY']}".encode()),
               (b"content-type", b"application/json")]
    sent: list[tuple[bytes, bytes]] = []

    async def payment() -> None:
        key, body = str(uuid.uuid4()).encode(), json.dumps(bodies.payment_body()).encode()
        status, _, answer = await asgi_post(app, "/v1/payments", [*headers, (b"idempotency-key", key)], body)
        if status != 201:
            raise NoFigure(f"a new payment was answered {status}: {answer[:300]!r}")
        sent.append((key, body))

    async def replay(i: int) -> None:
        key, body = sent[i % len(sent)]
        status, answered, _ = await asgi_post(app, "/v1/payments", [*headers, (b"idempotency-key", key)], body)
        if status != 201 or (variant in SAFE and answered.get(b"idempotent-replayed") != b"true"):
            raise NoFigure(f"a replay was answered {status} (Idempotent-Replayed: {answered.get(b'idempotent-replayed')})")

    async def run() -> None:
        async with app.router.lifespan_context(app):
            for _ in range(warmup):
                await payment()
            for i in range(warmup if variant in SAFE else 0):
                await replay(i)
            counted = os.environ.get(GREENLETS_OUT)  # natively only (`greenlets`): a Python call per switch
            for window in plan:
                metrics.flush()
                gc.collect()
                gc.freeze()
                started, seen = [0], weakref.WeakSet()
                if counted:
                    greenlet.settrace(lambda event, args: _count_start(started, seen, event, args))
                sys.getallocatedblocks()  # MARKERS: callgrind zeroes its counts here
                for i in range(window.requests):
                    await (payment() if window.kind == PAYMENTS else replay(i))
                metrics.flush()
                gc.get_freeze_count()  # MARKERS: and writes what it counted since, here
                if counted:
                    greenlet.settrace(None)
                    with open(counted, "a") as out:
                        out.write(json.dumps({"kind": window.kind, "requests": window.requests,
                                              "greenlets": started[0]}) + "\n")

    try:
        uvloop.install()
        asyncio.run(run())
    finally:
        if made is not None:
            multiproc.remove(made)


def _count_start(started: list[int], seen: weakref.WeakSet, event: str, args: tuple) -> None:
    """greenlet.settrace's callback: one more greenlet started, on the first switch into each (the main
    greenlet, which has no parent, is not one SQLAlchemy started)."""
    target = args[1]
    if event in ("switch", "throw") and target.parent is not None and target not in seen:
        seen.add(target)
        started[0] += 1


def greenlets_per_payment(stack: Stack, variant: str, low: int, high: int, warmup: int) -> float:
    """`variant`'s app run as under callgrind but natively, counting the greenlets started in each window: SQLAlchemy
    starts one for each of its awaits, and each maps and unmaps a stack of its own for Python's frames (system
    calls, which callgrind does not count). Per payment, by the difference of the two windows."""
    out = RESULTS / f"greenlets-{variant}.jsonl"
    out.unlink(missing_ok=True)
    plan = [Window(PAYMENTS, low), Window(PAYMENTS, high)]
    process = stack.system.api_process(f"greenlets-{variant}", command=COMMAND[variant], **SETTINGS[variant])
    process.env["BENCH_API_KEY"] = stack.api_key
    process.env[GREENLETS_OUT] = str(out)
    process.argv = drive_argv(variant, warmup, plan)
    process.port = None  # not a server: it drives itself, and exits
    process.log = LOGS / f"greenlets-{variant}.log"
    process.log.unlink(missing_ok=True)
    try:
        process.start()
        process.popen.wait(VALGRIND_STOP_SECONDS)
    except (NotHealthy, subprocess.TimeoutExpired) as exc:
        raise NoFigure(f"{variant}'s greenlets could not be counted ({exc}); see {process.log}") from None
    finally:
        process.stop()
    windows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if process.popen.returncode != 0 or len(windows) != len(plan):
        raise NoFigure(f"{variant}'s greenlet count wrote {len(windows)} windows of {len(plan)}; see {process.log}")
    return (windows[1]["greenlets"] - windows[0]["greenlets"]) / (high - low)


async def asgi_post(app, path: str, headers: list[tuple[bytes, bytes]], body: bytes
                    ) -> tuple[int, dict[bytes, bytes], bytes]:
    """One POST as an ASGI server hands it to the app (one message with the whole body); the status, the
    headers (lower case) and the body of the answer. No HTTP parsing: uvicorn's work is not in the count."""
    done = asyncio.Event()
    asked = False
    status, answered, chunks = 0, {}, []

    async def receive() -> dict:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()  # a middleware listening for the client going away hears it only after the answer
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status, answered
        if message["type"] == "http.response.start":
            status, answered = message["status"], {k.lower(): v for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                done.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": [(b"host", b"api"), (b"content-length", str(len(body)).encode()), *headers],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000), "state": {}}
    await app(scope, receive, send)
    return status, answered, b"".join(chunks)


# --- The database's cost per statement ---------------------------------------


STATEMENTS_SQL = """
SELECT s.query, s.calls, s.total_exec_time, s.mean_exec_time, s.rows,
       s.shared_blks_hit, s.shared_blks_read, s.shared_blks_dirtied, s.shared_blks_written,
       s.wal_bytes, s.wal_records, s.toplevel
  FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
 WHERE d.datname = $1
 ORDER BY s.total_exec_time DESC
"""


async def require_statements(url: str) -> None:
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


async def reset_statements(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("SELECT pg_stat_statements_reset()")
    finally:
        await conn.close()


async def read_statements(url: str, database: str = SERVICE_DATABASE) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetch(STATEMENTS_SQL, database)
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
        asyncio.run(reset_statements(server_url))
        send(process.url, stack.api_key, payments, 0, replayed=False)
        rows = asyncio.run(read_statements(server_url))
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


def show(rows: list[asyncpg.Record], payments: int, phases: dict[str, str], title: str, show_sql: bool,
         unit: str = "payment") -> None:
    """`rows` of pg_stat_statements as a table, each call's cost and the calls per `unit` (`payments` of them)."""
    table = Table(title=title, title_justify="left")
    for column in ("statement", f"calls/{unit}", "mean ms", "hit/call", "read/call", "dirtied/call",
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


@contextmanager
def patient_stack() -> Iterator[tuple[Stack, str]]:
    """What a measured API runs against: `bench_server`, the service's and the fakes' databases, a client, and
    the patient fakes; with the server's maintenance URL. Everything stops on leaving."""
    with System(LOGS) as system, bench_server(system) as server_url:
        system.create_database(RAILS_DATABASE, migrate=False)
        system.create_database(SERVICE_DATABASE)
        _, api_key = system.create_client("bench")
        with running(patient_fakes(system.postgres.database_url(RAILS_DATABASE))) as (psp, rail):
            system.psp, system.rail = psp, rail
            yield Stack(system, api_key), server_url


def main(
    low: int = typer.Option(10, min=1, help="Requests in the shorter window."),
    high: int = typer.Option(110, min=2, help="Requests in the longer window."),
    replays: bool = typer.Option(True, "--replays/--no-replays", help="Also count replays (phased only)."),
    warmup: int = typer.Option(10, min=1, help="Payments (and replays) before the first window; for "
                               "pg_stat_statements, before its statistics are reset."),
    repeats: int = typer.Option(2, min=2, help="Callgrind runs of each variant; their figures must agree."),
    tolerance: float = typer.Option(0.01, min=0, help="How far (a fraction) the repeats may disagree."),
    statements: int = typer.Option(200, min=0, help="Payments for pg_stat_statements; 0: skip it."),
    top: int = typer.Option(10, min=1, help="Statements shown, by total time."),
    variants: str = typer.Option(f"{PHASED},{NAIVE}", help="Any of phased, naive and unwatched (the phased "
                                 "service with metrics and logs off), comma-separated."),
    skip_callgrind: bool = typer.Option(False, "--skip-callgrind", help="No callgrind runs: only the database's cost "
                                        "per statement (and --greenlets)."),
    show_sql: bool = typer.Option(False, "--show-sql", help="Print each shown statement's text."),
    jobs: int = typer.Option(1, min=1, help="Callgrind runs at a time (each is one process, one CPU)."),
    greenlets: bool = typer.Option(False, "--greenlets", help="Also count the greenlets started per payment, "
                                   "in a native run of each variant."),
) -> None:
    """The API's instructions per payment under callgrind, and the database's cost per statement."""
    chosen = [v.strip() for v in variants.split(",") if v.strip()]
    if not chosen or set(chosen) - set(COMMAND) or high <= low:
        raise typer.BadParameter("--variants is any of phased, naive and unwatched; --high must exceed --low")
    try:
        if not skip_callgrind:
            console.print(subprocess.run([require_valgrind(), "--version"], capture_output=True, text=True).stdout.strip())
        with patient_stack() as (stack, server_url):
            asyncio.run(require_statements(server_url)) if statements else None
            if statements:
                for variant in chosen:
                    statement_costs(stack, server_url, variant, statements, warmup, top, show_sql)
            if greenlets:
                for variant in chosen:
                    console.print(f"{variant}: {greenlets_per_payment(stack, variant, low, high, warmup):.2f} "
                                  "greenlets started per payment")
            if not skip_callgrind:
                figures = instructions(stack, chosen, low, high, replays, repeats, warmup, jobs)
                report(figures, chosen, low, high, tolerance)
    except NoFigure as exc:
        console.print(f"[bold red]NO FIGURE: {exc}[/]")
        raise typer.Exit(1) from None


def report(figures: list[Instructions], chosen: list[str], low: int, high: int, tolerance: float) -> None:
    """Every repeat's figures, then each figure as the repeats' mean: no figure if they disagree."""
    table = Table(title=f"The app's instructions (callgrind Ir): windows of {high} and {low} requests, "
                        "one after another")
    for column in ("variant", "repeat", "Ir per payment", "Ir per replay"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for f in figures:
        table.add_row(f.variant, str(f.repeat), f"{f.per_payment:,.0f}",
                      "" if f.per_replay is None else f"{f.per_replay:,.0f}")
    wide.print(table)
    means, replay_means = {}, {}
    for variant in chosen:
        mine = [f for f in figures if f.variant == variant]
        means[variant] = agreed(f"{variant} per payment", [f.per_payment for f in mine], tolerance)
        console.print(f"{variant}: {means[variant]:,.0f} instructions per payment "
                      f"(repeats within {spread([f.per_payment for f in mine]):.2%})")
        if mine[0].per_replay is not None:
            replay = replay_means[variant] = agreed(f"{variant} per replay", [f.per_replay for f in mine], tolerance)
            console.print(f"{variant}: {replay:,.0f} instructions per replay "
                          f"(repeats within {spread([f.per_replay for f in mine]):.2%})")
    if set(chosen) == {PHASED, NAIVE}:
        for repeat in sorted({f.repeat for f in figures}):
            by = {f.variant: f.per_payment for f in figures if f.repeat == repeat}
            console.print(f"repeat {repeat}: phased ÷ naive per payment = {by[PHASED] / by[NAIVE]:.3f}")
        console.print(f"phased ÷ naive per payment = {means[PHASED] / means[NAIVE]:.3f}")
    if {PHASED, UNWATCHED} <= set(chosen):
        # What metrics and logs cost, in the app's own instructions.
        console.print(f"phased ÷ unwatched per payment = {means[PHASED] / means[UNWATCHED]:.4f}")
        if PHASED in replay_means and UNWATCHED in replay_means:
            console.print(f"phased ÷ unwatched per replay = {replay_means[PHASED] / replay_means[UNWATCHED]:.4f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--fake"]:
        serve_fake(sys.argv[2], sys.argv[3:])
    elif sys.argv[1:2] == ["--drive"]:
        drive(sys.argv[2], int(sys.argv[3]),
              [Window(kind, int(n)) for kind, n in (w.split(":") for w in sys.argv[4].split(","))])
    else:
        typer.run(main)
