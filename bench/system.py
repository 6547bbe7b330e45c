"""The system under test: the PostgreSQL server, the bench's databases, the processes.

Everything runs on this one machine, as `make run` runs it and started the
same way (devtools/system.py), each part in its own process (with an explicit
environment): PostgreSQL, the fake PSP, the fake rail, and the two APIs being
compared (the phased service and its naive twin). Two databases keep the
figures clean:

payments_bench
    The service's database: the phased service and the naive twin both write
    here (the twin in schema `naive`). Writing transactions per payment are
    counted in the WAL for this database alone.

payments_bench_rails
    The fakes' records. In the service's database they would add their own
    commits and WAL to the service's figures; in a database of their own they
    are still on the same server (and machine), but counted apart.

Both are dropped and created afresh on every run. Nothing else on the server
is touched: the embedded server may be serving other databases (a test run)
at the same time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import psutil
from rich.console import Console

from app.config import libpq_url
from devtools.processes import BIN, Process
from devtools.system import Postgres, System, with_database

__all__ = ["BIN", "with_database"]

SERVICE_DATABASE = "payments_bench"
RAILS_DATABASE = "payments_bench_rails"
RESULTS = Path(__file__).resolve().parent / "results"
LOGS = RESULTS / "logs"

# Tables are wide: in a log (not a terminal) they get 120 columns instead of rich's 80.
console = Console(width=None if sys.stdout.isatty() else 120)


# --- The database server ------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """The PostgreSQL server the bench runs on."""

    url: str  # the maintenance database (`postgres`)
    embedded: bool
    # The directory of the PostgreSQL tools (pgbench, pg_waldump) that match
    # the server: the embedded server's own; None for a server of DATABASE_URL.
    bin_dir: Path | None
    # devtools' System that started it (and creates the bench's databases on it).
    system: System = field(compare=False, repr=False)

    def database_url(self, name: str) -> str:
        return with_database(self.url, name)


@contextmanager
def database_server() -> Iterator[Server]:
    """DATABASE_URL's server, else the embedded one (started, and stopped afterwards, if it was not running)."""
    stopped = []

    def in_use(postgres: Postgres) -> bool:
        others = _other_sessions(postgres.url)
        if others:
            # We started it, but someone (a test run?) is using it now:
            # stopping it would break them. They, or the next user, stop it.
            console.print(f"embedded PostgreSQL left running: {others} other sessions are connected")
        else:
            stopped.append(True)
        return bool(others)

    with System(LOGS) as system:
        url = os.environ.get("DATABASE_URL")
        if url:
            console.print(f"PostgreSQL from DATABASE_URL ({urlsplit(libpq_url(url)).hostname})")
            postgres = system.start_postgres()
        else:
            with console.status("starting embedded PostgreSQL"):
                postgres = system.start_postgres(keep_running=in_use)
            console.print(f"PostgreSQL (embedded) on port {postgres.embedded.port}"
                          + ("" if postgres.started else ", already running"))
        yield Server(postgres.url, embedded=postgres.embedded is not None, bin_dir=postgres.bin_dir, system=system)
    if stopped:
        console.print("embedded PostgreSQL stopped")


def _other_sessions(server_url: str) -> int:
    """Client connections to databases other than ours (0 if the server is unreachable)."""

    async def count() -> int:
        conn = await asyncpg.connect(server_url)
        try:
            return await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
                "AND pid <> pg_backend_pid() AND NOT (datname = ANY($1::text[]))",
                [SERVICE_DATABASE, RAILS_DATABASE],
            )
        finally:
            await conn.close()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        run = asyncio.run  # the usual case: called from code that is not async
    else:
        # Called from inside an event loop (bench/db_rounds.py runs the whole
        # server's block in one), where asyncio.run refuses to start another:
        # the count gets a loop of its own, in a thread, and this waits for it.
        def run(coroutine):
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                return pool.submit(asyncio.run, coroutine).result()
    try:
        return run(count())
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return 0


@dataclass(frozen=True)
class Databases:
    service_url: str
    rails_url: str
    api_key: str  # of the client `bench`, which every load-generator request uses
    client_id: int
    # The client `bench-webhooks`: the same, with a webhook endpoint at the
    # fake merchant, so each of its payments also writes a delivery that the
    # worker's dispatcher POSTs during the run (the "webhooks" variant).
    webhook_api_key: str
    webhook_client_id: int
    webhook_secret: str
    webhook_secret_sealed: str  # as webhook_endpoint holds it (WEBHOOK_SECRETS_KEY: the system's)


def prepare_databases(server: Server) -> Databases:
    """Fresh `payments_bench` (migrated, with two clients) and `payments_bench_rails`."""
    from app.outbox.endpoints import new_secret

    with console.status("creating the bench databases"):
        rails_url = server.system.create_database(RAILS_DATABASE, migrate=False)
        service_url = server.system.create_database(SERVICE_DATABASE)
        client_id, api_key = server.system.create_client("bench")
        webhook_client_id, webhook_api_key = server.system.create_client("bench-webhooks")
    secret = new_secret()
    return Databases(service_url, rails_url, api_key, client_id, webhook_api_key, webhook_client_id, secret,
                     server.system.seal(secret))


def register_webhook(dbs: Databases, merchant: Service) -> None:
    """Point `bench-webhooks`'s endpoint at the fake merchant (which was started with its secret)."""

    async def insert() -> None:
        conn = await asyncpg.connect(dbs.service_url)
        try:
            await conn.execute("INSERT INTO webhook_endpoint (client_id, url, secret_sealed) VALUES ($1, $2, $3)",
                               dbs.webhook_client_id, merchant.url + "/webhooks", dbs.webhook_secret_sealed)
        finally:
            await conn.close()

    asyncio.run(insert())


async def set_events_per_post(dbs: Databases, events_per_post: int) -> None:
    """How many events the dispatcher may put in one POST to `bench-webhooks`'s endpoint, from its next read on."""
    conn = await asyncpg.connect(dbs.service_url)
    try:
        await conn.execute("UPDATE webhook_endpoint SET events_per_post = $2 WHERE client_id = $1",
                           dbs.webhook_client_id, events_per_post)
    finally:
        await conn.close()


# --- Processes ----------------------------------------------------------------


@dataclass
class Service(Process):
    """devtools' Process, plus what the bench measures: its whole process tree (uvicorn's workers)."""

    processes: int = 1  # the master plus its workers, once it is fully up

    @classmethod
    def of(cls, process: Process, name: str, processes: int = 1) -> Service:
        """`process` (from devtools/system.py) as a bench service, logging to bench/results/logs/<name>.log."""
        fields = {f.name: getattr(process, f.name) for f in dataclasses.fields(Process)}
        return cls(**fields | {"name": name, "log": LOGS / f"{name.replace(' ', '-')}.log", "timeout": 60,
                               "grace": 15}, processes=processes)

    def __post_init__(self) -> None:
        # Healthy, and every uvicorn worker listening (so none misses the load:
        # a connection made before a worker listens goes to another, for good).
        self.ready = lambda: len(self.tree()) >= self.processes and (
            self.processes == 1 or len(self.workers()) >= self.processes - 1)

    def start(self) -> Service:
        self.log.unlink(missing_ok=True)  # this run's output only
        super().start()
        return self

    def tree(self) -> list[psutil.Process]:
        """This service's processes: the one we started and every descendant (uvicorn's workers)."""
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def workers(self) -> list[psutil.Process]:
        """uvicorn's worker processes: the descendants listening on the service's port.

        Neither the supervisor (which may hold the port's socket too) nor
        helpers of Python's multiprocessing (its resource tracker) are counted.
        """
        workers = []
        for process in self.tree()[1:]:
            try:
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port
                       for c in process.net_connections("tcp")):
                    workers.append(process)
            except psutil.Error:
                pass
        return workers

    def client_ports(self) -> dict[int, set[int]]:
        """Each worker process's pid, and the clients' ports of the connections it holds (while the load's are open)."""
        held = {}
        for process in self.workers():
            try:
                held[process.pid] = {c.raddr.port for c in process.net_connections("tcp")
                                     if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == self.port}
            except psutil.Error:
                pass
        return held

    def stop(self) -> None:
        if not self.running:
            return
        children = self.tree()[1:]
        super().stop()  # uvicorn's master stops its workers
        for child in children:  # only if the master could not stop them
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass


PHASED, NAIVE = "phased", "naive"
# The phased service with its metrics and logs switched off: beside PHASED
# (metrics on, logging at INFO, the defaults) it prices watching the
# service (docs/operations.md#what-watching-costs).
UNWATCHED = "unwatched"
# The phased service again, paid by the client with a webhook endpoint. It
# runs in an API process of its own, with PHASED's settings, so that the
# watched and unwatched processes serve the same requests and nothing else:
# a comparison of watching that is like for like.
WEBHOOKS = "webhooks"
VARIANTS = (PHASED, UNWATCHED, WEBHOOKS, NAIVE)
SETTINGS = {
    PHASED: {"METRICS_ENABLED": "true", "LOG_LEVEL": "INFO", "LOG_FORMAT": "json"},
    UNWATCHED: {"METRICS_ENABLED": "false", "LOG_LEVEL": "WARNING", "LOG_FORMAT": "json"},
    NAIVE: {},
}
SETTINGS[WEBHOOKS] = SETTINGS[PHASED]


@contextmanager
def running(services: list[Service]) -> Iterator[list[Service]]:
    """Start `services` in order; stop them all, in reverse, however the block ends.

    A SIGTERM to the bench (`kill`, a timeout's) ends the block as an error
    would, so they are stopped then too: by default it would end the bench at
    once, and leave its APIs and fakes running with nobody to stop them.
    During the stopping, another SIGTERM is ignored, so that it cannot cut the
    stopping short.
    """
    main = threading.current_thread() is threading.main_thread()  # only there can a handler be set
    previous = signal.signal(signal.SIGTERM, _ended_by_sigterm) if main else None
    try:
        with System() as system:
            try:
                for service in services:
                    with console.status(f"starting {service.name}"):
                        system.spawn(service)
                yield services
            finally:
                if main:
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def _ended_by_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def fakes(rails_url: str, whose: str = "") -> list[Service]:
    """The fake PSP and the fake rail, keeping their records in the rails database.

    `whose` names a pair apart from the first ("fake PSP for naive at
    once"), in its name and its log.
    """
    system = System()
    suffix = f" for {whose}" if whose else ""
    return [Service.of(system.fake_process("psp", records_url=rails_url), f"fake PSP{suffix}"),
            Service.of(system.fake_process("rail", records_url=rails_url), f"fake rail{suffix}")]


def merchant_and_worker(dbs: Databases, psp: Service, rail: Service) -> list[Service]:
    """The fake merchant (records in the rails database) and one `payments worker`, whose dispatcher delivers."""
    system = System()
    system.database_url, system.psp, system.rail = dbs.service_url, psp, rail
    merchant = Service.of(system.fake_process("merchant", records_url=dbs.rails_url), "fake merchant")
    merchant.env["FAKE_MERCHANT_SECRETS"] = dbs.webhook_secret
    worker = Service.of(system.worker_process("worker"), "worker")
    worker.ready_line = "worker started"
    return [merchant, worker]


def apis(service_url: str, psp: Service, rail: Service, workers: int) -> dict[str, Service]:
    """The phased service (`payments api`) watched and unwatched, and the naive twin (`naive-twin`),
    `workers` processes each."""
    return {variant: api(service_url, psp, rail, workers, variant) for variant in VARIANTS}


def api(service_url: str, psp: Service, rail: Service, workers: int, variant: str, whose: str = "") -> Service:
    """One of `apis`: `variant`'s API calling `psp` and `rail`; `whose` names it apart ("phased API (1w) at once")."""
    system = System()
    system.database_url, system.psp, system.rail = service_url, psp, rail
    # uvicorn runs a single worker in its own process, and N > 1 in children of a master.
    processes = 1 if workers == 1 else workers + 1
    command = {PHASED: "api", UNWATCHED: "api", WEBHOOKS: "api", NAIVE: "naive-twin"}
    return Service.of(
        system.api_process(command=command[variant], args=("--workers", str(workers)), **SETTINGS[variant]),
        f"{variant} API ({workers}w){f' {whose}' if whose else ''}",
        processes=processes,
    )
