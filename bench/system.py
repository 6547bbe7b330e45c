"""The system under test: the PostgreSQL server, the bench's databases, the processes.

Everything runs on this one machine, as `make run` runs it, each part in its
own process: PostgreSQL, the fake PSP, the fake rail, and the two APIs being
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
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import psutil
from rich.console import Console

from app import embedded_db
from app.cli import create_client, migrate_database
from app.config import libpq_url
from app.processes import NotHealthy, free_port, stop_processes, wait_healthy

SERVICE_DATABASE = "payments_bench"
RAILS_DATABASE = "payments_bench_rails"
RESULTS = Path(__file__).resolve().parent / "results"
LOGS = RESULTS / "logs"
BIN = Path(sys.executable).parent

# Tables are wide: in a log (not a terminal) they get 120 columns instead of rich's 80.
console = Console(width=None if sys.stdout.isatty() else 120)


# --- The database server ------------------------------------------------------


def with_database(url: str, name: str) -> str:
    """`url` pointing at database `name` (query parameters kept)."""
    parts = urlsplit(libpq_url(url))
    return urlunsplit(parts._replace(path="/" + name))


@dataclass(frozen=True)
class Server:
    """The PostgreSQL server the bench runs on."""

    url: str  # the maintenance database (`postgres`)
    embedded: bool
    # The directory of the PostgreSQL tools (pgbench, pg_waldump) that match
    # the server: the embedded server's own; None for a server of DATABASE_URL.
    bin_dir: Path | None

    def database_url(self, name: str) -> str:
        return with_database(self.url, name)


@contextmanager
def database_server() -> Iterator[Server]:
    """DATABASE_URL's server, else the embedded one (started, and stopped afterwards, if it was not running)."""
    url = os.environ.get("DATABASE_URL")
    if url:
        console.print(f"PostgreSQL from DATABASE_URL ({urlsplit(libpq_url(url)).hostname})")
        yield Server(with_database(url, "postgres"), embedded=False, bin_dir=None)
        return
    server = embedded_db.default_server()
    with console.status("starting embedded PostgreSQL"):
        started = embedded_db.start(server)
    console.print(f"PostgreSQL (embedded) on port {server.port}" + ("" if started else ", already running"))
    try:
        yield Server(server.url(), embedded=True, bin_dir=server.bin_dir)
    finally:
        if started:
            others = _other_sessions(server.url())
            if others:
                # We started it, but someone (a test run?) is using it now:
                # stopping it would break them. They, or the next user, stop it.
                console.print(f"embedded PostgreSQL left running: {others} other sessions are connected")
            else:
                embedded_db.stop(server)
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
        return asyncio.run(count())
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return 0


@dataclass(frozen=True)
class Databases:
    service_url: str
    rails_url: str
    api_key: str  # of the client `bench`, which every load-generator request uses
    client_id: int


def prepare_databases(server: Server) -> Databases:
    """Fresh `payments_bench` (migrated, with a client) and `payments_bench_rails`."""
    with console.status("creating the bench databases"):
        for name in (SERVICE_DATABASE, RAILS_DATABASE):
            embedded_db.create_database(server.url, name, recreate=True)
        service_url = server.database_url(SERVICE_DATABASE)
        migrate_database(service_url)
        client_id, api_key = create_client(service_url, "bench")
    return Databases(service_url, server.database_url(RAILS_DATABASE), api_key, client_id)


# --- Processes ----------------------------------------------------------------


@dataclass
class Service:
    """One part of the system: a process (and its workers) on a free port, logging to a file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    processes: int = 1  # the master plus its workers, once it is fully up
    port: int = field(default_factory=free_port)
    popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return LOGS / f"{self.name.replace(' ', '-')}.log"

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def start(self) -> None:
        LOGS.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as log:
            self.popen = subprocess.Popen(
                [*self.argv, "--port", str(self.port)], env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            # Healthy, and every uvicorn worker up (so none misses the load).
            wait_healthy(self.name, self.url, self.popen, timeout=60,
                         ready=lambda: len(self.tree()) >= self.processes)
        except NotHealthy as exc:
            raise RuntimeError(f"{exc}: {self.log.read_text()[-2000:]}") from None

    def tree(self) -> list[psutil.Process]:
        """This service's processes: the one we started and every descendant (uvicorn's workers)."""
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        children = self.tree()[1:]
        stop_processes(self.popen, grace=15)  # uvicorn's master stops its workers
        for child in children:  # only if the master could not stop them
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass


PHASED, NAIVE = "phased", "naive"
VARIANTS = (PHASED, NAIVE)


@contextmanager
def running(services: list[Service]) -> Iterator[list[Service]]:
    """Start `services` in order; stop them all, in reverse, however the block ends."""
    started: list[Service] = []
    try:
        for service in services:
            with console.status(f"starting {service.name}"):
                started.append(service)
                service.start()
        yield services
    finally:
        for service in reversed(started):
            service.stop()


def fakes(rails_url: str) -> list[Service]:
    """The fake PSP and the fake rail, keeping their records in the rails database."""
    env = {**os.environ, "FAKE_RAILS_DATABASE_URL": rails_url}
    env.pop("DATABASE_URL", None)
    return [Service("fake PSP", [str(BIN / "fake-psp")], env), Service("fake rail", [str(BIN / "fake-rail")], env)]


def apis(service_url: str, psp: Service, rail: Service, workers: int) -> dict[str, Service]:
    """The phased service (`payments api`) and the naive twin (`payments naive-api`), `workers` processes each."""
    env = {**os.environ, "DATABASE_URL": service_url, "PSP_URL": psp.url, "RAIL_URL": rail.url}
    # uvicorn runs a single worker in its own process, and N > 1 in children of a master.
    processes = 1 if workers == 1 else workers + 1
    command = {PHASED: "api", NAIVE: "naive-api"}
    return {
        variant: Service(
            f"{variant} API ({workers}w)",
            [str(BIN / "payments"), command[variant], "--workers", str(workers)],
            env,
            processes=processes,
        )
        for variant in VARIANTS
    }
