"""The test harness: a real PostgreSQL, migrations, and real processes.

Without DATABASE_URL the suite starts the embedded PostgreSQL (the same one
`make run` uses) and stops it afterwards if it started it. With DATABASE_URL,
it uses that server. Either way it works in a database of its own,
`payments_test_<pid>`, created by migrations at the start of the run and
dropped at its end, so a user's data is never touched and two runs at once
(two checkouts, a developer and a helper) never share tables.

The system is started the one way devtools/system.py starts it (as for
`make run`, the demos and the bench), part by part as the fixtures need it:
`server_url`, `database_url`, then `stack`. Every process gets an explicit
environment, never the caller's (`no_caller_settings`).

The fake PSP, the fake rail and two API processes run as separate processes
for the whole session (`stack`); every integration and crash test starts from
empty tables and an empty fault plan (`clean`). Unit tests need none of it.
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx
import pytest

from app import client_accounts
from app.config import Settings
from app.outbox import endpoints, sealing
from devtools.processes import BIN, Process
from devtools.system import System

TEST_DATABASE = f"payments_test_{os.getpid()}"
LEGACY_IBAN = "GB82WEST12345698765432"  # payouts to this account go over the legacy path
# Read once, before `no_caller_settings` takes it out of os.environ: the
# server the tests run on is the caller's choice; nothing else is.
CALLER_DATABASE_URL = os.environ.get("DATABASE_URL")
# What every service process of the tests gets, on top of where the database
# and the fakes are. Short enough timeouts that a hang-after-applying fault
# resolves in a test, long enough for a loaded 2-core machine.
# The secret the fake rail signs its notifications of returns with (set on
# the rail by `clean`), and every API process verifies them with.
RAIL_SECRET = "whsec_" + base64.b64encode(b"the test rail's notification secret").decode()
# The key this run's webhook signing secrets are sealed with (a fresh one:
# a test database lives for one run).
SECRETS_KEY = sealing.new_key()
TEST_SETTINGS = {
    "PSP_TIMEOUT_SECONDS": "2",
    "RAIL_TIMEOUT_SECONDS": "2",
    "RAIL_LEGACY_ACCOUNTS": LEGACY_IBAN,
    "RAIL_NOTIFICATION_SECRET": RAIL_SECRET,
    "WEBHOOK_SECRETS_KEY": SECRETS_KEY,
}


def service_setting_names(environ: dict[str, str] | os._Environ) -> list[str]:
    """The variables of `environ` that app.config.Settings would read (it ignores case)."""
    names = set()
    for name, field in Settings.model_fields.items():
        names.add(name.lower())
        names.update(a.lower() for a in (field.alias, field.validation_alias) if isinstance(a, str))
    return [variable for variable in environ if variable.lower() in names]


@pytest.fixture(scope="session", autouse=True)
def no_caller_settings() -> Iterator[None]:
    """The caller's service settings (PAYMENTS_CRASH_AT, LEASE_SECONDS, ...) are not this run's.

    Processes the tests start get an explicit environment anyway
    (devtools/processes.py::child_env); this keeps a Settings(...) built in
    the pytest process itself from reading them too.
    """
    removed = {name: os.environ.pop(name) for name in service_setting_names(os.environ)}
    yield
    os.environ.update(removed)


@pytest.fixture(scope="session")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    """The tests' system (devtools/system.py), started part by part by the fixtures below; stopped at the end."""
    with System(tmp_path_factory.mktemp("logs"), settings=TEST_SETTINGS) as system:
        yield system


@pytest.fixture(scope="session")
def server_url(system: System) -> str:
    """A maintenance URL (database `postgres`) on the server the tests use."""
    return system.start_postgres(server_url=CALLER_DATABASE_URL).url


@pytest.fixture(scope="session")
def database_url(system: System, server_url: str) -> str:
    """A fresh database for this run whose schema comes only from migrations (dropped at the end)."""
    return system.create_database(TEST_DATABASE, drop_at_end=True)


@dataclass
class Stack:
    psp: Process
    rail: Process
    apis: list[Process]

    @property
    def api(self) -> str:
        return self.apis[0].url


@pytest.fixture(scope="session")
def stack(system: System, database_url: str) -> Stack:
    """The fake PSP, the fake rail and two API processes, for the whole session."""
    # One beneficiary bank behind the rail is legacy (no keys, no probes), as
    # in real life; the cut-off is off so no test depends on the hour it runs.
    psp, rail = system.start_fakes(rail_args=("--legacy-accounts", LEGACY_IBAN, "--cutoff", "24:00"))
    # The second API answers replays through the route, the first through the
    # replay shortcut (app/api/replay_shortcut.py): a test that retries on the
    # other API crosses both paths, and they must give the same answer.
    return Stack(
        psp, rail,
        [system.start_api("api-a", REPLAY_SHORTCUT="true"), system.start_api("api-b", REPLAY_SHORTCUT="false")],
    )


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
        "TRUNCATE reconciliation_break, scheduled_run, ledger_entry, idempotency_key, rail_message, payment, client, "
        "event, webhook_endpoint, webhook_delivery, webhook_attempt, console_session, "
        "fake_psp.charge, fake_psp.refund, fake_psp.request, fake_rail.transfer, fake_rail.closed_day, "
        "fake_rail.request, fake_rail.notification_attempt, fake_rail.notification, fake_rail.transfer_return"
    )
    async with httpx.AsyncClient() as client:
        for rail in (stack.psp, stack.rail):
            (await client.delete(rail.url + "/_admin/faults")).raise_for_status()
        # The rail notifies returns to the first API (a test may point it elsewhere).
        notify = {"url": stack.api + "/v1/rail/notifications", "secret": RAIL_SECRET}
        (await client.put(stack.rail.url + "/_admin/notify", json=notify)).raise_for_status()


@pytest.fixture(scope="session")
def merchant(system: System, stack: Stack) -> Process:
    """The fake merchant (a webhook endpoint), for the whole session; its records in the test database."""
    return system.start_merchant()


@dataclass(frozen=True)
class Client:
    id: int
    api_key: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


def seal(secret: str) -> str:
    """A webhook signing secret as the service stores it (webhook_endpoint.secret_sealed)."""
    return sealing.SecretsKey(SECRETS_KEY).seal(secret)


async def make_client(db: asyncpg.Connection, name: str) -> Client:
    api_key = client_accounts.new_api_key()
    client_id = await db.fetchval(
        "INSERT INTO client (name, api_key_hash) VALUES ($1, $2) RETURNING id", name, client_accounts.hash_api_key(api_key)
    )
    return Client(client_id, api_key)


@dataclass(frozen=True)
class Shop(Client):
    """A client whose events are POSTed to the fake merchant, which knows its signing secret."""

    webhook_url: str
    secret: str


@pytest.fixture
async def shop(db: asyncpg.Connection, stack: Stack, merchant: Process, clean: None) -> Shop:
    """A client with a webhook endpoint at the fake merchant; the merchant's records and faults emptied."""
    await db.execute(
        "TRUNCATE fake_merchant.processed_message, fake_merchant.payment, fake_merchant.received, "
        "fake_merchant.secret, fake_merchant.request"
    )
    client = await make_client(db, "shop")
    secret = endpoints.new_secret()
    url = merchant.url + "/webhooks"
    await db.execute("INSERT INTO webhook_endpoint (client_id, url, secret_sealed) VALUES ($1, $2, $3)",
                     client.id, url, seal(secret))
    async with httpx.AsyncClient() as http:
        (await http.delete(merchant.url + "/_admin/faults")).raise_for_status()
        (await http.put(merchant.url + "/_admin/secrets", json={"secrets": [secret]})).raise_for_status()
    return Shop(client.id, client.api_key, url, secret)


@pytest.fixture
async def acme(db: asyncpg.Connection, stack: Stack) -> Client:
    return await make_client(db, "acme")


@pytest.fixture
async def globex(db: asyncpg.Connection, stack: Stack) -> Client:
    return await make_client(db, "globex")


class Processes:
    """Processes a single test starts (and kills); all are stopped when it ends."""

    def __init__(self, system: System) -> None:
        self.system = system  # the session's system, scoped to this test (system.py::System.scope)
        self.started = system.processes

    def api(self, name: str = "api", command: str = "api", **env: str) -> Process:
        """An API process (`command="naive-twin"` for the naive twin)."""
        return self.system.start_api(name, command=command, **env)

    def fake(self, kind: str, *args: str, port: int | None = None) -> Process:
        """A fake PSP or rail of this test's own (`kind` "psp" or "rail"), e.g. to stop and restart it."""
        return self.system.start_fake(kind, *args, port=port)

    def worker(self, name: str = "worker", **env: str) -> subprocess.Popen:
        """A recovery worker, once it is up (system.py::System.start_worker)."""
        return self.system.start_worker(name, **env).popen

    async def cli(self, *args: str, **env: str) -> tuple[int, str]:
        """Run `payments <args>` to completion; its exit code and output."""
        process = await asyncio.create_subprocess_exec(
            str(BIN / "payments"), *args, env=self.system.service_env(**env),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await process.communicate()
        return process.returncode, output.decode()

    def stop_all(self) -> None:
        for process in self.started:
            process.kill()
        self.system.stop()


@pytest.fixture
def processes(system: System, stack: Stack, tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(system.scope(tmp_path))
    yield procs
    procs.stop_all()
