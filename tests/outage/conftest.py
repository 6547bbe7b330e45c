"""A private stack for tests that take the database away.

The session's stack (tests/conftest.py) shares one PostgreSQL server with
every other test, and with other checkouts running tests at the same time;
stopping it, or terminating its backends, would break them. So the tests here
get a PostgreSQL server of their own (the embedded one, on its own data
directory and free port), migrate a database on it, and start an API (two),
a recovery worker, and the fake PSP and rail against it.

The fakes keep their records in a database of their own on the *session's*
server (created and dropped here, never the session's test database): the PSP
and the rail are other people's systems, and our database going away must not
take their records with it. It also keeps pg_terminate_backend on our
database from cutting the fakes' connections.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import pytest

from app import embedded_db
from app.cli import migrate_database
from app.processes import free_port
from tests.conftest import BIN, Process, _wait_for_log_line, api_env

# Short leases: an owner whose release could not reach the database keeps its
# lease until it expires, and a test should not wait 30 s for that. Long
# enough for a loaded 2-core machine to finish a phase and its call.
LEASE_SECONDS = "5"
WORKER = {"WORKER_POLL_SECONDS": "0.2", "WORKER_MIN_AGE_SECONDS": "1"}


def _in_thread(fn, *args, **kwargs) -> None:
    # Each runs its own event loop (asyncio.run), which cannot nest in pytest-asyncio's.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(fn, *args, **kwargs).result()


@dataclass
class PrivateStack:
    server: embedded_db.EmbeddedServer
    database_url: str  # ours: keys, payments, ledger
    fakes_url: str  # the fake PSP's and rail's records
    psp: Process
    rail: Process
    apis: list[Process]
    worker: Process
    logs: Path
    started: list[Process] = field(default_factory=list)

    @property
    def api(self) -> str:
        return self.apis[0].url

    def start_api(self, name: str, **env: str) -> Process:
        """Another API process on this stack (stopped with the stack)."""
        port = free_port()
        process = Process(
            name, [str(BIN / "payments"), "api", "--port", str(port)],
            api_env(self.database_url, self.psp, self.rail, **({"LEASE_SECONDS": LEASE_SECONDS} | env)),
            port, self.logs / f"{name}-{port}.log",
        )
        self.started.append(process)
        return process.start()

    def start_worker(self, name: str) -> Process:
        """A recovery worker, once it logs that it started (it needs no database for that)."""
        env = api_env(self.database_url, self.psp, self.rail, LEASE_SECONDS=LEASE_SECONDS, **WORKER)
        process = Process(name, [str(BIN / "payments"), "worker"], env, 0, self.logs / f"{name}.log")
        process.popen = subprocess.Popen(process.argv, env=env, stdout=process.log.open("ab"), stderr=subprocess.STDOUT)
        self.started.append(process)
        _wait_for_log_line(process, "worker started")
        return process

    async def stop_database(self) -> None:
        """pg_ctl stop -m fast: every connection is cut, new ones are refused."""
        await asyncio.to_thread(embedded_db.stop, self.server)

    async def start_database(self) -> None:
        await asyncio.to_thread(embedded_db.start, self.server)


@pytest.fixture(scope="module")
def private_stack(server_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateStack]:
    root = tmp_path_factory.mktemp("private-pg")
    logs = tmp_path_factory.mktemp("private-logs")
    server = embedded_db.EmbeddedServer(root / "data", free_port())
    embedded_db.start(server)
    fakes_db = f"payments_outage_fakes_{os.getpid()}"
    fakes_url = server_url.rsplit("/", 1)[0] + "/" + fakes_db
    started: list[Process] = []
    stack = None
    try:
        database_url = server.url("payments")
        _in_thread(embedded_db.create_database, server.url(), "payments")
        _in_thread(migrate_database, database_url)
        _in_thread(embedded_db.create_database, server_url, fakes_db, recreate=True)

        fakes_env = {**os.environ, "FAKE_RAILS_DATABASE_URL": fakes_url}
        psp = Process("fake-psp", [], fakes_env, free_port(), logs / "psp.log")
        psp.argv = [str(BIN / "fake-psp"), "--port", str(psp.port)]
        rail = Process("fake-rail", [], fakes_env, free_port(), logs / "rail.log")
        rail.argv = [str(BIN / "fake-rail"), "--port", str(rail.port), "--cutoff", "24:00"]
        started += [psp.start(), rail.start()]
        stack = PrivateStack(server, database_url, fakes_url, psp, rail, [], None, logs, started)  # type: ignore[arg-type]
        stack.apis = [stack.start_api("api-a"), stack.start_api("api-b")]
        stack.worker = stack.start_worker("worker")
        yield stack
    finally:
        for process in reversed(started):
            process.stop()
        embedded_db.stop(server)
        _in_thread(embedded_db.drop_database, server_url, fakes_db)


@pytest.fixture
async def ours(private_stack: PrivateStack) -> asyncpg.Connection:
    """A connection to the private stack's own database, for set-up and assertions."""
    conn = await asyncpg.connect(private_stack.database_url)
    yield conn
    if not conn.is_closed():
        await conn.close()


@pytest.fixture
async def theirs(private_stack: PrivateStack) -> asyncpg.Connection:
    """A connection to the fakes' database: the PSP's charges, the rail's transfers."""
    conn = await asyncpg.connect(private_stack.fakes_url)
    yield conn
    await conn.close()
