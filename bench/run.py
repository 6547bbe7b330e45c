"""`make bench`: how fast the exactly-once payment path is, and what each payment costs.

It starts the real system (PostgreSQL, the fake PSP, the fake rail and the
payment API, each in its own process, as `make run` does), drives it from this
process with N concurrent clients, and prints what it measured next to the
machine it measured on. Every figure is there for a reason:

new payments/s, p50 / p99 / max latency
    The cost of the whole five-step flow: claim the key, charge the card,
    record the charge, pay out over the rail, record the payout. Each payment
    makes two HTTP calls and three database phases, so it can never be cheap;
    what matters is how it moves when the code changes. p99 and max show the
    queueing that an average hides.

replays/s, replay p50 / p99
    A retry of a finished payment (same Idempotency-Key, same body) must get
    the stored response back, byte for byte, with `Idempotent-Replayed: true`,
    and must touch neither the PSP nor the rail. Clients retry exactly when the
    system is struggling, so a replay has to be much cheaper than a payment:
    a few reads, no writes. If replays/s is not many times payments/s,
    retries will pile onto an overloaded service.

commits per payment (and per replay)
    `xact_commit` of the bench database in `pg_stat_database`, divided by the
    payments (replays) made. It shows the phase design at work: the target is
    three *writing* transactions per payment (claim + create; record charge;
    record payout), none held open across an external call. `xact_commit`
    counts more than that: read-only transactions too (the API key lookup,
    stored-response reads), and the fake PSP and rail keep their records in
    this same database, so their transactions are counted as well (2 per
    request each: its own and asyncpg's connection reset when its pool gets
    the connection back). So a payment shows 8 = 1 key lookup + 3 phases +
    2 x 2 at the fakes; a replay 3. Compare runs, not the absolute number.
    Next to it: transaction ids assigned (only a writing transaction gets
    one: 3 of ours + 1 each at the PSP and the rail = 5 per payment, 0 per
    replay) and WAL bytes written. Both are cluster-wide, so anything else
    writing to the same server meanwhile is counted too.

CPU ms per payment
    Per process (this load generator, the API, each fake) and for the whole
    machine. On a small machine everything competes for the same cores; a
    load generator that eats a core is part of the result.

exactly-once check
    After the run, SQL over the bench database must agree with the clients:
    every 201 has its payment row, payments = PSP charges = rail transfers, no
    reference was charged or paid out twice, the amounts match, and every
    payment's ledger entries balance. A fast wrong answer does not pass: the
    bench exits non-zero on FAIL.

How it measures
    Each phase (warm-up, new payments, replays) runs the clients for a fixed
    time; a client starts a request only before the deadline and the rate is
    taken over the time until the last one finished. Latency is that of
    successful requests. New payments each carry a fresh key and a fresh
    reference. Replays cycle over up to 500 keys that finished in the
    new-payment phase. PostgreSQL 15+ may hold a backend's statistics back for
    up to 10 s, so the bench lets the system idle 11 s before each statistics
    reading (and calls `pg_stat_force_next_flush()`); nothing else runs in
    the bench database meanwhile (autovacuum may add a handful).

    It works in its own database, `payments_bench`, dropped and re-created on
    every run, on the server DATABASE_URL names, else on the embedded
    PostgreSQL (started, and stopped afterwards, if it was not running). The
    load generator is httpx (aiohttp is not a dependency) on uvloop when
    available; figures from different machines, or from a machine doing other
    work, are not comparable: compare variants side by side, as ratios (see
    PERFORMANCE.md: runs differ by +/-15-25%).

Usage: `make bench` (about 90 s: warm-up, two 20 s phases, three 11 s idles),
or `.venv/bin/python -m bench.run --duration 5 --warmup 1`.
Results: the terminal, bench/results/bench-<UTC timestamp>.json, service logs
in bench/results/logs/.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx
import psutil
import typer
from rich.console import Console
from rich.table import Table

from app import embedded_db
from app.cli import create_client, migrate_database
from app.config import libpq_url

BENCH_DATABASE = "payments_bench"
RESULTS = Path(__file__).resolve().parent / "results"
LOGS = RESULTS / "logs"
BIN = Path(sys.executable).parent
REPLAY_KEYS = 500
# PostgreSQL 15+ flushes an idle backend's pending statistics within 10 s.
STATS_SETTLE_SECONDS = 11.0

console = Console()


# --- Database -----------------------------------------------------------------


def with_database(url: str, name: str) -> str:
    """`url` pointing at database `name` (query parameters kept)."""
    parts = urlsplit(libpq_url(url))
    return urlunsplit(parts._replace(path="/" + name))


@contextmanager
def database_server() -> Iterator[str]:
    """A maintenance URL (database `postgres`): DATABASE_URL's server, else the embedded one."""
    url = os.environ.get("DATABASE_URL")
    if url:
        console.print(f"PostgreSQL from DATABASE_URL ({urlsplit(libpq_url(url)).hostname})")
        yield with_database(url, "postgres")
        return
    server = embedded_db.default_server()
    with console.status("starting embedded PostgreSQL"):
        started = embedded_db.start(server)
    console.print(f"PostgreSQL (embedded) on port {server.port}" + ("" if started else ", already running"))
    try:
        yield server.url()
    finally:
        if started:
            others = other_sessions(server.url())
            if others:
                # We started it, but someone (a test run?) is using it now:
                # stopping it would break them. They, or the next user, stop it.
                console.print(f"embedded PostgreSQL left running: {others} other sessions are connected")
            else:
                embedded_db.stop(server)
                console.print("embedded PostgreSQL stopped")


def other_sessions(server_url: str) -> int:
    """Client connections to databases other than ours (0 if the server is unreachable)."""

    async def count() -> int:
        conn = await asyncpg.connect(server_url)
        try:
            return await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
                "AND pid <> pg_backend_pid() AND datname IS DISTINCT FROM $1",
                BENCH_DATABASE,
            )
        finally:
            await conn.close()

    try:
        return asyncio.run(count())
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return 0


def prepare_database(server_url: str) -> tuple[str, str]:
    """A fresh, migrated `payments_bench` and a client in it: (url, api key)."""
    embedded_db.create_database(server_url, BENCH_DATABASE, recreate=True)
    url = with_database(server_url, BENCH_DATABASE)
    migrate_database(url)
    _, api_key = create_client(url, "bench")
    return url, api_key


# --- Services -----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    """One of the system's processes, on a free port, logging to a file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int = field(default_factory=free_port)
    popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return LOGS / f"{self.name}.log"

    def start(self) -> None:
        LOGS.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as log:
            self.popen = subprocess.Popen(
                [*self.argv, "--port", str(self.port)], env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # readiness polling, bounded by the deadline
        raise RuntimeError(f"{self.name} did not become healthy: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.terminate()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def cpu_seconds(self) -> float:
        assert self.popen is not None
        times = psutil.Process(self.popen.pid).cpu_times()
        return times.user + times.system


@contextmanager
def running_services(database_url: str) -> Iterator[dict[str, Service]]:
    """fake-psp, fake-rail and the API, started in that order and always stopped."""
    fakes_env = {**os.environ, "FAKE_RAILS_DATABASE_URL": database_url}
    psp = Service("fake-psp", [str(BIN / "fake-psp")], fakes_env)
    rail = Service("fake-rail", [str(BIN / "fake-rail")], fakes_env)
    api_env = {**os.environ, "DATABASE_URL": database_url, "PSP_URL": psp.url, "RAIL_URL": rail.url}
    api = Service("api", [str(BIN / "payments"), "api"], api_env)
    services = {"fake PSP": psp, "fake rail": rail, "API": api}
    try:
        for name, service in services.items():
            with console.status(f"starting {name}"):
                service.start()
        console.print(f"API {api.url}, fake PSP {psp.url}, fake rail {rail.url}; logs in {LOGS}")
        yield services
    finally:
        for service in reversed(services.values()):
            service.stop()


# --- Load ---------------------------------------------------------------------


@dataclass(frozen=True)
class Paid:
    """A payment that got its 201: what a replay must send, and get back."""

    key: str
    reference: str
    body: bytes
    response: bytes


@dataclass
class PhaseResult:
    """What the clients saw in one timed phase."""

    latencies: list[float] = field(default_factory=list)  # seconds, successful requests only
    statuses: Counter[str] = field(default_factory=Counter)
    paid: list[Paid] = field(default_factory=list)
    elapsed: float = 0.0

    @property
    def succeeded(self) -> int:
        return len(self.latencies)

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    @property
    def per_second(self) -> float:
        return self.succeeded / self.elapsed if self.elapsed else 0.0

    def latency_ms(self) -> dict[str, float | None]:
        ordered = sorted(self.latencies)
        return {
            "p50": percentile(ordered, 0.50),
            "p99": percentile(ordered, 0.99),
            "max": ordered[-1] * 1000 if ordered else None,
            "mean": sum(ordered) / len(ordered) * 1000 if ordered else None,
        }

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "succeeded": self.succeeded,
            "elapsed_s": round(self.elapsed, 3),
            "per_second": round(self.per_second, 1),
            "latency_ms": {k: None if v is None else round(v, 2) for k, v in self.latency_ms().items()},
            "statuses": dict(sorted(self.statuses.items())),
        }


def percentile(ordered: list[float], q: float) -> float | None:
    """Nearest-rank percentile of sorted seconds, in milliseconds."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1000


def payment_body(reference: str) -> bytes:
    return json.dumps(
        {
            "amount": 1250,
            "currency": "EUR",
            "reference": reference,
            "card_token": "tok_visa",
            "beneficiary": {"name": "Ada Lovelace", "iban": "DE89370400440532013000"},
        }
    ).encode()


Request = Callable[[httpx.AsyncClient, PhaseResult], Awaitable[None]]


async def run_phase(http: httpx.AsyncClient, request: Request, concurrency: int, duration: float) -> PhaseResult:
    """`concurrency` clients, each sending `request` after `request` until the deadline."""
    result = PhaseResult()
    deadline = time.monotonic() + duration

    async def client() -> None:
        while time.monotonic() < deadline:
            await request(http, result)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    result.elapsed = time.perf_counter() - start
    return result


async def new_payment(http: httpx.AsyncClient, result: PhaseResult) -> None:
    """A payment never seen before: fresh key, fresh reference. Success is a 201."""
    key, reference = str(uuid.uuid4()), f"bench-{uuid.uuid4().hex}"
    body = payment_body(reference)
    started = time.perf_counter()
    try:
        response = await http.post("/v1/payments", content=body, headers={"Idempotency-Key": key})
    except httpx.HTTPError as exc:
        result.statuses[f"error: {type(exc).__name__}"] += 1
        return
    elapsed = time.perf_counter() - started
    result.statuses[str(response.status_code)] += 1
    if response.status_code == 201:
        result.latencies.append(elapsed)
        result.paid.append(Paid(key, reference, body, response.content))


def replayer(paid: list[Paid]) -> Request:
    """Retries of finished payments, round robin. Success is the stored 201, byte for byte."""
    cycle = itertools.cycle(paid)

    async def replay(http: httpx.AsyncClient, result: PhaseResult) -> None:
        original = next(cycle)
        started = time.perf_counter()
        try:
            response = await http.post("/v1/payments", content=original.body, headers={"Idempotency-Key": original.key})
        except httpx.HTTPError as exc:
            result.statuses[f"error: {type(exc).__name__}"] += 1
            return
        elapsed = time.perf_counter() - started
        if response.status_code != 201:
            result.statuses[str(response.status_code)] += 1
        elif response.headers.get("Idempotent-Replayed") != "true":
            result.statuses["201 without Idempotent-Replayed: true (error)"] += 1
        elif response.content != original.response:
            result.statuses["201 with a different body (error)"] += 1
        else:
            result.statuses["201 replayed"] += 1
            result.latencies.append(elapsed)

    return replay


# --- Costs: database statistics and CPU ----------------------------------------


@dataclass(frozen=True)
class DbStats:
    xact_commit: int
    next_xid: int | None  # cluster-wide
    wal_lsn: str | None  # cluster-wide


class StatsReader:
    """Reads the bench database's counters from a connection to another database,
    so that reading them does not count itself."""

    def __init__(self, conn: asyncpg.Connection, version_num: int) -> None:
        self.conn, self.version_num = conn, version_num

    @property
    def settle_seconds(self) -> float:
        return STATS_SETTLE_SECONDS if self.version_num >= 150000 else 1.0

    async def settled(self) -> DbStats:
        """The counters once every backend has published its statistics."""
        with console.status(f"idling {self.settle_seconds:.0f} s for PostgreSQL to publish its statistics"):
            await asyncio.sleep(self.settle_seconds)
        if self.version_num >= 150000:
            await self.conn.execute("SELECT pg_stat_force_next_flush()")
        await self.conn.execute("SELECT pg_stat_clear_snapshot()")
        xact_commit = await self.conn.fetchval(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = $1", BENCH_DATABASE
        )
        next_xid = wal_lsn = None
        if self.version_num >= 130000:
            next_xid = await self.conn.fetchval("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
        if not await self.conn.fetchval("SELECT pg_is_in_recovery()"):
            wal_lsn = await self.conn.fetchval("SELECT pg_current_wal_lsn()::text")
        return DbStats(xact_commit, next_xid, wal_lsn)

    async def costs(self, before: DbStats, after: DbStats, count: int) -> dict[str, float | None]:
        """Per-operation deltas of the counters, for `count` operations."""
        if count == 0:
            return {"xact_commit": None, "xids": None, "wal_bytes": None}
        wal_bytes = None
        if before.wal_lsn and after.wal_lsn:
            wal_bytes = await self.conn.fetchval(
                "SELECT pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn)::float8", after.wal_lsn, before.wal_lsn
            )
        xids = None if before.next_xid is None else (after.next_xid - before.next_xid) / count
        return {
            "xact_commit": (after.xact_commit - before.xact_commit) / count,
            "xids": xids,
            "wal_bytes": None if wal_bytes is None else wal_bytes / count,
        }


class CpuMeter:
    """CPU seconds of each of our processes and of the whole machine, between two marks."""

    def __init__(self, services: dict[str, Service]) -> None:
        self.services = services

    def mark(self) -> dict[str, float]:
        me = psutil.Process().cpu_times()
        machine = psutil.cpu_times()
        marks = {"load generator": me.user + me.system}
        marks |= {name: service.cpu_seconds() for name, service in self.services.items()}
        marks["machine"] = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
        return marks

    @staticmethod
    def per_operation_ms(before: dict[str, float], after: dict[str, float], count: int) -> dict[str, float | None]:
        spent = {name: after[name] - before[name] for name in before}
        ours = sum(v for name, v in spent.items() if name != "machine")
        spent["PostgreSQL and the rest of the machine"] = spent["machine"] - ours
        return {name: (v * 1000 / count if count else None) for name, v in spent.items()}

    @staticmethod
    def busy_percent(before: dict[str, float], after: dict[str, float], elapsed: float) -> float | None:
        """How busy all the machine's CPUs were, on average, between the marks."""
        if not elapsed:
            return None
        return 100 * (after["machine"] - before["machine"]) / (elapsed * (os.cpu_count() or 1))


# --- The exactly-once check -----------------------------------------------------


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


async def exactly_once(conn: asyncpg.Connection, paid: list[Paid], replays: PhaseResult) -> list[Check]:
    """What the database says happened must be what exactly-once promises.

    Every bench payment has a reference of its own and a card that is never
    declined, so any second charge or transfer for a reference is a duplicate.
    """

    async def count(sql: str, *args: Any) -> int:
        return await conn.fetchval(f"SELECT count(*) FROM ({sql}) AS x", *args)

    payments = await count("SELECT 1 FROM payment")
    charges = await count("SELECT 1 FROM fake_psp.charge")
    transfers = await count("SELECT 1 FROM fake_rail.transfer")
    statuses = dict(await conn.fetch("SELECT status, count(*) FROM payment GROUP BY status ORDER BY status"))
    references = [p.reference for p in paid]
    recorded = await count("SELECT 1 FROM payment WHERE reference = ANY($1::text[])", references)
    charged_twice = await count("SELECT reference FROM fake_psp.charge GROUP BY reference HAVING count(*) > 1")
    paid_out_twice = await count("SELECT reference FROM fake_rail.transfer GROUP BY reference HAVING count(*) > 1")
    amounts_differ = await count(
        "SELECT 1 FROM payment p JOIN fake_psp.charge c USING (reference) WHERE c.amount <> p.amount_minor "
        "UNION ALL "
        "SELECT 1 FROM payment p JOIN fake_rail.transfer t USING (reference) WHERE t.amount <> p.net_minor"
    )
    unbalanced = await count(
        "SELECT payment_id FROM ledger_entry GROUP BY payment_id HAVING sum(debit_minor) <> sum(credit_minor)"
    )
    unposted = await count(
        "SELECT 1 FROM payment p WHERE NOT EXISTS (SELECT 1 FROM ledger_entry l WHERE l.payment_id = p.id)"
    )
    bad_replays = sum(n for status, n in replays.statuses.items() if status != "201 replayed")
    return [
        Check("every 201 has its payment row", recorded == len(set(references)) == len(references),
              f"{len(references)} answered 201, {recorded} found"),
        Check("payments = PSP charges = rail transfers", payments == charges == transfers,
              f"{payments} = {charges} = {transfers}; payments by status: {statuses}"),
        Check("no reference charged twice", charged_twice == 0, f"{charged_twice} references"),
        Check("no reference paid out twice", paid_out_twice == 0, f"{paid_out_twice} references"),
        Check("charge and payout amounts match the payment", amounts_differ == 0, f"{amounts_differ} differ"),
        Check("ledger balances per payment", unbalanced == 0 and unposted == 0,
              f"{unbalanced} unbalanced, {unposted} payments without entries"),
        Check("every replay got the stored 201 back", bad_replays == 0 and replays.succeeded > 0,
              f"{replays.succeeded} replayed, {bad_replays} did not"),
    ]


# --- Machine --------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


async def machine(conn: asyncpg.Connection) -> dict[str, Any]:
    settings = dict(await conn.fetch(
        "SELECT name, setting FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit', 'max_connections')"
    ))
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_1m_at_start": round(os.getloadavg()[0], 2),  # others' work shows here
        "postgresql": await conn.fetchval("SHOW server_version"),
        "postgresql_settings": settings,
        "python": platform.python_version(),
    }


# --- The benchmark ----------------------------------------------------------------


async def benchmark(
    server_url: str, services: dict[str, Service], api_key: str, concurrency: int, duration: float, warmup: float
) -> dict[str, Any]:
    maintenance = await asyncpg.connect(server_url)
    try:
        version_num = await maintenance.fetchval("SELECT current_setting('server_version_num')::int")
        stats = StatsReader(maintenance, version_num)
        about_machine = await machine(maintenance)
        cpu = CpuMeter(services)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        async with httpx.AsyncClient(
            base_url=services["API"].url, headers=headers, limits=limits, timeout=30
        ) as http:
            console.print(f"warm-up: {warmup:g} s of new payments (not counted)")
            warm = await run_phase(http, new_payment, concurrency, warmup)

            before = await stats.settled()
            console.print(f"new payments: {concurrency} clients for {duration:g} s")
            cpu_before = cpu.mark()
            new = await run_phase(http, new_payment, concurrency, duration)
            cpu_after = cpu.mark()
            after_new = await stats.settled()

            replay_set = new.paid[:REPLAY_KEYS]
            if replay_set:
                console.print(f"replays: {concurrency} clients for {duration:g} s over {len(replay_set)} finished keys")
                cpu_before_replays = cpu.mark()
                replays = await run_phase(http, replayer(replay_set), concurrency, duration)
                cpu_after_replays = cpu.mark()
                after_replays = await stats.settled()
            else:
                console.print("[red]no payment finished: nothing to replay[/]")
                replays, after_replays = PhaseResult(), after_new
                cpu_before_replays = cpu_after_replays = cpu_after

        bench_db = await asyncpg.connect(with_database(server_url, BENCH_DATABASE))
        try:
            checks = await exactly_once(bench_db, warm.paid + new.paid, replays)
        finally:
            await bench_db.close()
        return {
            "machine": about_machine,
            "new_payments": new.summary(),
            "replays": replays.summary() | {"keys": len(replay_set)},
            "warmup": {"requests": warm.requests, "succeeded": warm.succeeded},
            "per_payment": await stats.costs(before, after_new, new.succeeded),
            "per_replay": await stats.costs(after_new, after_replays, replays.succeeded),
            "cpu_ms_per_payment": cpu.per_operation_ms(cpu_before, cpu_after, new.succeeded),
            "cpu_ms_per_replay": cpu.per_operation_ms(cpu_before_replays, cpu_after_replays, replays.succeeded),
            "machine_busy_percent": {
                "new_payments": cpu.busy_percent(cpu_before, cpu_after, new.elapsed),
                "replays": cpu.busy_percent(cpu_before_replays, cpu_after_replays, replays.elapsed),
            },
            "exactly_once": {
                "pass": all(c.ok for c in checks),
                "checks": [{"check": c.name, "ok": c.ok, "detail": c.detail} for c in checks],
            },
        }
    finally:
        await maintenance.close()


# --- Report -------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def notes(results: dict[str, Any]) -> list[str]:
    """What a reader must know to read the figures right."""
    said = [
        "Latency counts successful requests only; replays cycle over "
        f"{results['replays']['keys']} keys paid in the new-payment phase.",
        "commits = xact_commit of the bench database: read-only transactions count too (API key lookups, "
        "stored-response reads), and so do the fake PSP's and rail's, which share this database "
        "(2 per request each: its transaction and its pool's connection reset).",
        "xids (one per writing transaction) and WAL bytes are cluster-wide. Target: 3 writing "
        "transactions of ours + 1 each at the PSP and the rail = 5 per payment; 0 per replay.",
    ]
    for phase, cpu in (("payment", results["cpu_ms_per_payment"]), ("replay", results["cpu_ms_per_replay"])):
        client, api = cpu["load generator"], cpu["API"]
        if client is not None and api is not None and client > api:
            said.append(
                f"The load generator spent more CPU per {phase} ({client:.2f} ms) than the API ({api:.2f} ms) "
                f"on a {os.cpu_count()}-CPU machine: the {phase}s/s figure is partly a measure of the client."
            )
    return said


def report(results: dict[str, Any]) -> None:
    new, rep = results["new_payments"], results["replays"]
    per_payment, per_replay = results["per_payment"], results["per_replay"]
    ratio = rep["per_second"] / new["per_second"] if new["per_second"] else None

    figures = Table(title="Payments benchmark", title_justify="left")
    figures.add_column("figure")
    figures.add_column("new payments", justify="right")
    figures.add_column("replays", justify="right")
    figures.add_row("per second", fmt(new["per_second"]), f"{fmt(rep['per_second'])} ({fmt(ratio)}×)")
    figures.add_row("successes", f"{new['succeeded']:,} in {new['elapsed_s']:.1f} s",
                    f"{rep['succeeded']:,} in {rep['elapsed_s']:.1f} s")
    for q in ("p50", "p99", "max"):
        figures.add_row(f"latency {q} (ms)", fmt(new["latency_ms"][q]), fmt(rep["latency_ms"][q]))
    figures.add_row(
        "commits (xact_commit) per op", fmt(per_payment["xact_commit"], 2), fmt(per_replay["xact_commit"], 2)
    )
    figures.add_row("writing txns (xids) per op", fmt(per_payment["xids"], 2), fmt(per_replay["xids"], 2))
    figures.add_row("WAL bytes per op", fmt(per_payment["wal_bytes"], 0), fmt(per_replay["wal_bytes"], 0))
    console.print(figures)
    for note in results["notes"]:
        console.print(f"[dim]- {note}[/]")

    busy = results["machine_busy_percent"]
    cpu = Table(title="CPU ms per operation", title_justify="left")
    cpu.add_column("process")
    cpu.add_column("per payment", justify="right")
    cpu.add_column("per replay", justify="right")
    for name, ms in results["cpu_ms_per_payment"].items():
        if name != "machine":
            cpu.add_row(name, fmt(ms, 2), fmt(results["cpu_ms_per_replay"][name], 2))
    cpu.add_row("whole machine", fmt(results["cpu_ms_per_payment"]["machine"], 2),
                fmt(results["cpu_ms_per_replay"]["machine"], 2))
    cpu.add_row("machine busy (all CPUs)", f"{fmt(busy['new_payments'], 0)}%", f"{fmt(busy['replays'], 0)}%")
    console.print(cpu)

    statuses = Table(title="Requests by status", title_justify="left")
    statuses.add_column("phase")
    statuses.add_column("status")
    statuses.add_column("count", justify="right")
    statuses.add_row("warm-up", "201", str(results["warmup"]["succeeded"]))
    statuses.add_row("warm-up", "other", str(results["warmup"]["requests"] - results["warmup"]["succeeded"]))
    for phase, data in (("new payments", new), ("replays", rep)):
        for status, n in data["statuses"].items():
            statuses.add_row(phase, status, str(n))
    console.print(statuses)

    m, p = results["machine"], results["parameters"]
    setup = Table(title="Machine and parameters", title_justify="left", show_header=False)
    setup.add_column("name")
    setup.add_column("value")
    pg_settings = ", ".join(f"{k}={v}" for k, v in m["postgresql_settings"].items())
    setup.add_row(
        "machine",
        f"{m['nproc']} CPUs, {m['cpu_model']}, {m['memory_gib']} GiB, load {m['load_average_1m_at_start']} at start",
    )
    setup.add_row("PostgreSQL", f"{m['postgresql']} ({pg_settings}), {p['database']}")
    setup.add_row(
        "parameters",
        f"concurrency {p['concurrency']}, duration {p['duration_s']:g} s, warm-up {p['warmup_s']:g} s",
    )
    setup.add_row("load generator", f"{p['load_generator']}, Python {m['python']}")
    console.print(setup)

    checks = Table(title="Exactly-once check", title_justify="left")
    checks.add_column("check")
    checks.add_column("result")
    checks.add_column("detail", style="dim")
    for c in results["exactly_once"]["checks"]:
        checks.add_row(c["check"], "[green]ok[/]" if c["ok"] else "[red]FAIL[/]", c["detail"])
    console.print(checks)
    verdict = "[bold green]PASS[/]" if results["exactly_once"]["pass"] else "[bold red]FAIL[/]"
    console.print(f"exactly-once: {verdict}")


# --- CLI ----------------------------------------------------------------------------


def event_loop_factory() -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    try:
        import uvloop
    except ImportError:
        return None, "asyncio"
    return uvloop.new_event_loop, "uvloop"


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(
    concurrency: int = typer.Option(32, min=1, help="Concurrent clients."),
    duration: float = typer.Option(20.0, min=0.5, help="Seconds of each measured phase (new payments, replays)."),
    warmup: float = typer.Option(3.0, min=0.0, help="Seconds of new payments before measuring (not counted)."),
) -> None:
    """Measure new payments and replays against the real processes, then check exactly-once."""
    signal.signal(signal.SIGTERM, _interrupt)
    started_at = datetime.now(UTC)
    loop_factory, loop_name = event_loop_factory()
    try:
        with database_server() as server_url:
            database_url, api_key = prepare_database(server_url)
            with running_services(database_url) as services, asyncio.Runner(loop_factory=loop_factory) as runner:
                results = runner.run(benchmark(server_url, services, api_key, concurrency, duration, warmup))
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]: every process started here was stopped")
        raise typer.Exit(130) from None
    except (asyncpg.InterfaceError, asyncpg.PostgresConnectionError, ConnectionError) as exc:
        # A shared server (the embedded one is reused if it is running) may be
        # stopped by whoever started it; the figures of such a run mean nothing.
        console.print(f"[red]lost PostgreSQL mid-run ({exc}); was it stopped by another process?[/]")
        raise typer.Exit(2) from None

    results = {
        "timestamp": started_at.isoformat(timespec="seconds"),
        "parameters": {
            "concurrency": concurrency,
            "duration_s": duration,
            "warmup_s": warmup,
            "replay_keys_max": REPLAY_KEYS,
            "database": BENCH_DATABASE
            + (" on DATABASE_URL's server" if os.environ.get("DATABASE_URL") else " (embedded)"),
            "load_generator": f"httpx {httpx.__version__} on {loop_name}",
        },
        **results,
    }
    results["notes"] = notes(results)
    report(results)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"bench-{started_at.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"results: {path}")
    if not results["exactly_once"]["pass"]:
        raise typer.Exit(1)


cli = typer.Typer(add_completion=False)
cli.command()(main)

if __name__ == "__main__":
    cli()
