"""The test harness: a real PostgreSQL, migrations, and real processes.

Without DATABASE_URL the suite starts the embedded PostgreSQL (the same one
`make run` uses) and stops it afterwards if it started it. With DATABASE_URL,
it uses that server. Either way it works in a database of its own,
`payments_test_<pid>`, created by migrations at the start of the run and
dropped at its end, so a user's data is never touched and two runs at once
(two checkouts, a developer and a helper) never share tables.

The fake PSP, the fake rail and two API processes run as separate processes
for the whole session (`stack`); every integration and crash test starts from
empty tables and an empty fault plan (`clean`). Unit tests need none of it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx
import pytest

from app import clients, embedded_db
from app.cli import migrate_database
from app.config import libpq_url
from app.processes import NotHealthy, free_port, stop_processes, wait_healthy

TEST_DATABASE = f"payments_test_{os.getpid()}"
LEGACY_IBAN = "GB82WEST12345698765432"  # payouts to this account go over the legacy path
BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """A maintenance URL (database `postgres`) on the server the tests use."""
    url = os.environ.get("DATABASE_URL")
    if url:
        yield libpq_url(url).rsplit("/", 1)[0] + "/postgres"
        return
    server = embedded_db.default_server()
    started = embedded_db.start(server)
    yield server.url()
    if started:
        embedded_db.stop(server)


@pytest.fixture(scope="session")
def database_url(server_url: str) -> Iterator[str]:
    """A fresh database for this run whose schema comes only from migrations."""
    url = server_url.rsplit("/", 1)[0] + "/" + TEST_DATABASE

    def prepare() -> None:
        embedded_db.create_database(server_url, TEST_DATABASE, recreate=True)
        migrate_database(url)

    # Both run their own event loop (asyncio.run), which cannot nest inside
    # pytest-asyncio's running one, so they get a thread of their own.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(prepare).result()
    yield url
    with ThreadPoolExecutor(1) as pool:
        pool.submit(embedded_db.drop_database, server_url, TEST_DATABASE).result()


@dataclass
class Process:
    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log: Path
    popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Process:
        self.popen = subprocess.Popen(
            self.argv, env=self.env, stdout=self.log.open("ab"), stderr=subprocess.STDOUT
        )
        try:
            wait_healthy(self.name, self.url, self.popen)
        except NotHealthy as exc:
            raise RuntimeError(f"{exc}: {self.log.read_text()[-2000:]}") from None
        return self

    def stop(self) -> None:
        if self.popen:
            stop_processes(self.popen)


@dataclass
class Stack:
    psp: Process
    rail: Process
    apis: list[Process]

    @property
    def api(self) -> str:
        return self.apis[0].url


def api_env(database_url: str, psp: Process, rail: Process, **overrides: str) -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": database_url,
        "PSP_URL": psp.url,
        "RAIL_URL": rail.url,
        # Short enough that a hang-after-applying fault resolves in a test,
        # long enough for a loaded 2-core machine.
        "PSP_TIMEOUT_SECONDS": "2",
        "RAIL_TIMEOUT_SECONDS": "2",
        "RAIL_LEGACY_ACCOUNTS": LEGACY_IBAN,
        **overrides,
    }


@pytest.fixture(scope="session")
def stack(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("logs")
    env = {**os.environ, "FAKE_RAILS_DATABASE_URL": database_url}
    psp = Process("fake-psp", [], env, free_port(), logs / "psp.log")
    psp.argv = [str(BIN / "fake-psp"), "--port", str(psp.port)]
    rail = Process("fake-rail", [], env, free_port(), logs / "rail.log")
    # One beneficiary bank behind the rail is legacy (no keys, no probes), as
    # in real life; the cut-off is off so no test depends on the hour it runs.
    rail.argv = [str(BIN / "fake-rail"), "--port", str(rail.port), "--legacy-accounts", LEGACY_IBAN, "--cutoff", "24:00"]
    apis = []
    # The second API answers replays through the route, the first through the
    # replay shortcut (app/api/replay_shortcut.py): a test that retries on the
    # other API crosses both paths, and they must give the same answer.
    for name, shortcut in (("api-a", "true"), ("api-b", "false")):
        port = free_port()
        apis.append(
            Process(
                name,
                [str(BIN / "payments"), "api", "--port", str(port)],
                api_env(database_url, psp, rail, REPLAY_SHORTCUT=shortcut),
                port,
                logs / f"{name}.log",
            )
        )
    started: list[Process] = []
    try:
        for process in (psp, rail, *apis):
            started.append(process.start())
        yield Stack(psp, rail, apis)
    finally:
        for process in started:
            process.stop()


@pytest.fixture(scope="session")
async def db(database_url: str) -> asyncpg.Connection:
    """A connection for assertions on durable state (and for test set-up)."""
    conn = await asyncpg.connect(database_url)
    yield conn
    await conn.close()


@pytest.fixture(scope="session")
async def http() -> httpx.AsyncClient:
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=200)) as client:
        yield client


@pytest.fixture
async def clean(stack: Stack, db: asyncpg.Connection) -> None:
    """Empty tables and fault plans; autouse in integration/ and crash/."""
    await db.execute(
        "TRUNCATE reconciliation_break, scheduled_run, ledger_entry, idempotency_key, payment, client, "
        "fake_psp.charge, fake_psp.refund, fake_psp.request, fake_rail.transfer, fake_rail.closed_day, "
        "fake_rail.request"
    )
    async with httpx.AsyncClient() as client:
        for rail in (stack.psp, stack.rail):
            (await client.delete(rail.url + "/_admin/faults")).raise_for_status()


@dataclass(frozen=True)
class Client:
    id: int
    api_key: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


async def make_client(db: asyncpg.Connection, name: str) -> Client:
    api_key = clients.new_api_key()
    client_id = await db.fetchval(
        "INSERT INTO client (name, api_key_hash) VALUES ($1, $2) RETURNING id", name, clients.hash_api_key(api_key)
    )
    return Client(client_id, api_key)


@pytest.fixture
async def acme(db: asyncpg.Connection, stack: Stack) -> Client:
    return await make_client(db, "acme")


@pytest.fixture
async def globex(db: asyncpg.Connection, stack: Stack) -> Client:
    return await make_client(db, "globex")


class Processes:
    """Processes a single test starts (and kills); all are stopped when it ends."""

    def __init__(self, database_url: str, stack: Stack, logs: Path) -> None:
        self.database_url, self.stack, self.logs = database_url, stack, logs
        self.started: list[Process] = []

    def api(self, name: str = "api", command: str = "api", **env: str) -> Process:
        """An API process (`command="naive-api"` for the naive twin)."""
        port = free_port()
        process = Process(
            name, [str(BIN / "payments"), command, "--port", str(port)],
            api_env(self.database_url, self.stack.psp, self.stack.rail, **env), port, self.logs / f"{name}-{port}.log",
        )
        self.started.append(process)
        return process.start()

    def fake(self, kind: str, *args: str, port: int | None = None) -> Process:
        """A fake PSP or rail of this test's own (`kind` "psp" or "rail"), e.g. to stop and restart it."""
        port = port or free_port()
        env = {**os.environ, "FAKE_RAILS_DATABASE_URL": self.database_url}
        argv = [str(BIN / f"fake-{kind}"), "--port", str(port), *args]
        process = Process(f"fake-{kind}", argv, env, port, self.logs / f"fake-{kind}-{port}.log")
        self.started.append(process)
        return process.start()

    def worker(self, name: str = "worker", **env: str) -> subprocess.Popen:
        """A recovery worker, once it is up.

        It has no HTTP face, so "up" is the line it logs once its signal
        handlers are installed and its services open: from then on a SIGTERM
        stops it cleanly (exit 0). Before it, a SIGTERM kills it outright.
        """
        env = api_env(self.database_url, self.stack.psp, self.stack.rail, **env)
        process = Process(name, [str(BIN / "payments"), "worker"], env, 0, self.logs / f"{name}-{len(self.started)}.log")
        process.popen = subprocess.Popen(
            process.argv, env=env, stdout=process.log.open("ab"), stderr=subprocess.STDOUT
        )
        self.started.append(process)
        _wait_for_log_line(process, "worker started")
        return process.popen

    async def cli(self, *args: str, **env: str) -> tuple[int, str]:
        """Run `payments <args>` to completion; its exit code and output."""
        process = await asyncio.create_subprocess_exec(
            str(BIN / "payments"), *args,
            env=api_env(self.database_url, self.stack.psp, self.stack.rail, **env),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await process.communicate()
        return process.returncode, output.decode()

    def stop_all(self) -> None:
        for process in self.started:
            if process.popen and process.popen.poll() is None:
                process.popen.kill()
                process.popen.wait(10)


def _wait_for_log_line(process: Process, line: str, timeout: float = 30.0) -> None:
    """Return once `line` is in the process's log; fail if it exits or the timeout passes first."""
    deadline = time.monotonic() + timeout
    while line not in process.log.read_text(errors="replace"):
        exited = process.popen.poll()
        if exited is not None or time.monotonic() > deadline:
            state = "timed out" if exited is None else f"exited with {exited}"
            raise RuntimeError(f"{process.name} {state} before logging {line!r}: {process.log.read_text()[-2000:]}")
        time.sleep(0.02)  # readiness polling, bounded by the deadline


@pytest.fixture
def processes(database_url: str, stack: Stack, tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(database_url, stack, tmp_path)
    yield procs
    procs.stop_all()
