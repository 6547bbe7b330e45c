"""The test harness: a real PostgreSQL, migrations, and real processes.

Without DATABASE_URL the suite starts the embedded PostgreSQL (the same one
`make run` uses) and stops it afterwards if it started it. With DATABASE_URL,
it uses that server. Either way it works in a database of its own,
`payments_test_<pid>`, created by migrations at the start of the run and
dropped at its end, so a user's data is never touched and two runs at once
(two checkouts, a developer and a helper) never share tables.

`make test` spreads the tests over worker processes (pytest-xdist, `-n N`).
Each worker is a session of its own, so everything below is per worker: its
own database (the pid is the worker's), its own stack on free ports, its own
processes to kill. Only the server is shared, started once by the process
that hands out the tests (`pytest_sessionstart`). A module whose tests share
a process runs on one worker (ONE_WORKER_MODULES). `pytest` alone, `-n 0` or
`-p no:xdist` runs every test in the one process, the same way.

The system is started the one way devtools/system.py starts it (as for
`make run`, the demos and the bench), part by part as the fixtures need it:
`server_url`, `database_url`, then `stack`. Every process gets an explicit
environment, never the caller's (`no_caller_settings`).

The fake PSP, the fake rail and two API processes run as separate processes
for the whole session (`stack`); every integration and crash test starts from
empty tables and an empty fault plan (`clean`). Unit tests, and the tests of
the tooling (tests/tooling/: the bench, the soak's audit, the docs, nginx's
configurations, this harness), need none of it.
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx
import pytest

from app import client_accounts
from app.config import Settings
from app.outbox import endpoints, sealing
from devtools import embedded_db
from devtools.processes import BIN, Process
from devtools.system import System, with_database

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


# -- spread over xdist workers (`make test`: pytest -n N) ---------------------

def spread_over_workers(config: pytest.Config) -> bool:
    """This process hands the tests to xdist workers (`-n N`, N > 0) and runs none itself."""
    # xdist's own test: it hands out tests unless --dist is "no" (as `-n 0` makes it).
    handing_out = getattr(config.option, "dist", "no") != "no" and not config.option.collectonly
    return handing_out and not hasattr(config, "workerinput")


CONTROLLER_SYSTEM = pytest.StashKey[System]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """With workers, the server is started here, once, before any of them asks for it.

    Each worker's `server_url` then finds it running and leaves it running
    (System.start_postgres stops only what it started itself), and it is
    stopped here after the last worker has finished, if this run started it.
    """
    if spread_over_workers(session.config):
        system = System()
        system.start_postgres(server_url=CALLER_DATABASE_URL)
        session.config.stash[CONTROLLER_SYSTEM] = system


def pytest_unconfigure(config: pytest.Config) -> None:
    if CONTROLLER_SYSTEM in config.stash:
        config.stash[CONTROLLER_SYSTEM].stop()


# `-n auto` (`make test`): more workers than this machine's two cores, as
# most tests wait on the processes they start rather than compute.
WORKERS = 3
# What one worker may hold open on the server at once: its two API
# processes' pools (grown to their size by the concurrency tests, and kept)
# and the three fakes', its tests' own processes and connections, and for
# the outage tests the fakes of their private stack.
CONNECTIONS_PER_WORKER = 100


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: WORKERS, or as many as the server has connections for, at least one."""
    return max(1, min(WORKERS, asyncio.run(connection_room()) // CONNECTIONS_PER_WORKER))


async def connection_room() -> int:
    """How many more connections the tests' server takes now (the embedded one: once started)."""
    if CALLER_DATABASE_URL:
        url = with_database(CALLER_DATABASE_URL, "postgres")
    else:
        server = embedded_db.default_server()
        if not embedded_db.is_accepting(server.port):
            return embedded_db.MAX_CONNECTIONS
        url = server.url()
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval(
            "SELECT current_setting('max_connections')::int - current_setting('superuser_reserved_connections')::int"
            " - (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')"
        )
    finally:
        await conn.close()


# Modules whose tests share a module-scoped fixture that starts a server or
# a process: it is started once per worker that runs one of their tests, so
# each of these runs on one worker.
ONE_WORKER_MODULES = (
    "tests/outage/test_database_outage.py",  # a PostgreSQL server of its own, and a stack on it
    "tests/console/test_console_pages.py",  # an API process with the console switched on
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's `load` (each test to the next free worker), but a module of ONE_WORKER_MODULES whole.

    Not `--dist loadgroup` with xdist_group marks: with pytest 9.2 its
    groups never reach the scheduler (pytest-xdist issue 1386). `loadscope`'s
    scheduler, cutting the tests into these units, does it, and sends the
    larger units out first.
    """
    if config.getvalue("dist") != "load":
        return None  # the caller chose another distribution
    from xdist.scheduler import LoadScopeScheduling

    class ModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_WORKER_MODULES else nodeid

    return ModulesTogether(config, log)


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
    # A kept-alive connection is dropped by this client well before the API
    # closes it (TIMEOUT_KEEP_ALIVE, 5 s, in app/cli.py): with the two equal, a
    # request sent on a connection idle for just under 5 s met the server's
    # close and failed with ReadError (a .ci/run failure).
    limits = httpx.Limits(max_connections=200, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        yield client


# Every table a test may write, children before their parents (a row is
# deleted before the row it references).
SERVICE_TABLES = (
    "webhook_attempt", "webhook_delivery", "webhook_endpoint", "event", "reconciliation_break", "ledger_entry",
    "rail_message", "idempotency_key", "batch_outbox", "payment_batch_row", "payment_batch", "refund", "payment",
    "client", "scheduled_run", "console_session",
    "fake_psp.refund", "fake_psp.charge", "fake_psp.request", "fake_psp.closed_day",
    "fake_rail.notification_attempt", "fake_rail.notification", "fake_rail.transfer_return", "fake_rail.transfer",
    "fake_rail.closed_day", "fake_rail.request",
)
MERCHANT_TABLES = (
    "fake_merchant.processed_message", "fake_merchant.payment", "fake_merchant.received", "fake_merchant.secret",
    "fake_merchant.request",
)
# Whether autovacuum has analysed any of the tables (or a partition of one)
# since it was last truncated: reltuples is -1 until then.
ANALYSED = """
    SELECT count(*) FROM unnest($1::text[]::regclass[]) AS t, pg_partition_tree(t) AS p
      JOIN pg_class c ON c.oid = p.relid
     WHERE p.isleaf AND c.reltuples >= 0
"""


async def empty_tables(db: asyncpg.Connection, tables: tuple[str, ...]) -> None:
    """Leave `tables` as TRUNCATE leaves them, by the cheaper DELETE where that is the same.

    TRUNCATE gives each table, each of the key table's partitions and every
    index new files, and makes each connection of the API processes rebuild
    its cache of them: before every test. DELETE does neither. The tables are
    locked first, all at once, as TRUNCATE locks them, so that nothing still
    running from the last test writes in between. DELETE keeps a table's
    statistics, which TRUNCATE resets; once autovacuum has gathered some,
    the planner reads an empty table whole instead of through its index
    (which test_key_table.py checks), so then the tables are TRUNCATEd.
    """
    async with db.transaction():
        # replica: no trigger fires for these DELETEs, so `client_is_never_deleted`
        # (migration 0013) lets this reset empty `client` as TRUNCATE would.
        await db.execute("SET LOCAL session_replication_role = replica; "
                         f"LOCK TABLE {', '.join(tables)} IN ACCESS EXCLUSIVE MODE; "
                         + " ".join(f"DELETE FROM {table};" for table in tables))
    if await db.fetchval(ANALYSED, list(tables)):
        await db.execute(f"TRUNCATE {', '.join(tables)}")


@pytest.fixture
async def clean(stack: Stack, db: asyncpg.Connection, http: httpx.AsyncClient) -> None:
    """Empty tables and fault plans; autouse in integration/ and crash/."""
    await empty_tables(db, SERVICE_TABLES)
    # The webhook cursor's one row, as the migration leaves it: a worker
    # killed by the last test may have left its lease held.
    await db.execute("UPDATE webhook_cursor SET written_by = '0', event_id = $1, lease_token = NULL, "
                     "lease_expires_at = NULL", uuid.UUID(int=0))
    for rail in (stack.psp, stack.rail):
        (await http.delete(rail.url + "/_admin/faults")).raise_for_status()
    # The rail notifies returns to the first API (a test may point it elsewhere).
    notify = {"url": stack.api + "/v1/rail/notifications", "secret": RAIL_SECRET}
    (await http.put(stack.rail.url + "/_admin/notify", json=notify)).raise_for_status()


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
async def shop(db: asyncpg.Connection, stack: Stack, merchant: Process, http: httpx.AsyncClient, clean: None) -> Shop:
    """A client with a webhook endpoint at the fake merchant; the merchant's records and faults emptied."""
    await empty_tables(db, MERCHANT_TABLES)
    client = await make_client(db, "shop")
    secret = endpoints.new_secret()
    url = merchant.url + "/webhooks"
    await db.execute("INSERT INTO webhook_endpoint (client_id, url, secret_sealed) VALUES ($1, $2, $3)",
                     client.id, url, seal(secret))
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
