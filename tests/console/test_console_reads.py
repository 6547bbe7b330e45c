"""Reads where they belong: the console's pages on DATABASE_READ_URL, everything else on the primary.

DATABASE_READ_URL may name a standby (docs/failover.md#reads-on-a-standby).
Two API processes prove the separation in both directions, each with the
console on and DATABASE_URL at the session's database (the primary):

- one whose DATABASE_READ_URL is an address where nothing listens: payments,
  refunds, reads of a payment and console sessions, which must not touch it,
  work; the pages, which must, answer 503 problem+json (never a 500);
- one whose DATABASE_READ_URL is another database (a stale copy, with rows
  the primary lacks and without the primary's): the pages show the copy,
  a client's GET shows the primary, and a session revoked on the primary is
  dead at once even where the copy still holds it open.

Each test names the one-line bug it catches.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import asyncpg
import httpx
import pytest

from app.admin import migrate_database
from devtools.processes import Process, free_port
from devtools.system import System, off_loop
from tests.console.conftest import OPERATOR_TOKEN
from tests.support import charges, headers, payment_body

OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
PAGES = ("/console", "/console/parked", "/console/reconciliation", "/console/webhooks")
COPY_DATABASE = f"payments_copy_{os.getpid()}"


@pytest.fixture(scope="module")
def copy_url(system: System, stack) -> str:
    """A second database on the session's server, migrated and empty: the standby that is not up to date."""
    url = system.create_database(COPY_DATABASE, drop_at_end=True, migrate=False)
    off_loop(migrate_database, url, system.secrets_key)
    return url


@pytest.fixture
async def copy(copy_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(copy_url)
    await conn.execute("TRUNCATE console_session, client CASCADE")
    yield conn
    await conn.close()


@pytest.fixture(scope="module")
def reads_nowhere(system: System, stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """An API whose DATABASE_READ_URL is a port where nothing listens (a connection there is refused)."""
    scoped = system.scope(tmp_path_factory.mktemp("reads-nowhere"))
    nowhere = f"postgresql://postgres@127.0.0.1:{free_port()}/payments"
    try:
        yield scoped.start_api("api-reads-nowhere", OPERATOR_TOKEN=OPERATOR_TOKEN, DATABASE_READ_URL=nowhere)
    finally:
        scoped.stop()


@pytest.fixture(scope="module")
def reads_copy(system: System, stack, copy_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """An API whose DATABASE_READ_URL is the stale copy."""
    scoped = system.scope(tmp_path_factory.mktemp("reads-copy"))
    try:
        yield scoped.start_api("api-reads-copy", OPERATOR_TOKEN=OPERATOR_TOKEN, DATABASE_READ_URL=copy_url)
    finally:
        scoped.stop()


async def log_in(url: str) -> str:
    """A fresh login's session cookie (a browser of its own: the shared client keeps no console cookie)."""
    async with httpx.AsyncClient(base_url=url) as browser:
        response = await browser.post("/console/login", data={"token": OPERATOR_TOKEN, "next": "/console"})
    assert response.status_code == 303, response.text
    return response.cookies["console_session"]


def browser(url: str, session: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, cookies={"console_session": session})


async def test_an_unreachable_read_database_stops_no_payment_refund_or_login(http, db, reads_nowhere, acme):
    """Catches: a payment's or a refund's path, a login or a logout reading from or writing to DATABASE_READ_URL."""
    api = reads_nowhere.url
    body = payment_body()
    created = await http.post(f"{api}/v1/payments", json=body, headers=headers(acme, str(uuid.uuid4())))
    assert created.status_code == 201, created.text
    payment = created.json()
    got = await http.get(f"{api}/v1/payments/{payment['id']}", headers=acme.auth)
    assert got.status_code == 200 and got.json()["status"] == payment["status"] == "succeeded"
    refund = await http.post(f"{api}/v1/payments/{payment['id']}/refunds", json={"amount": 100, "reference": "r-1", "reason": "one returned"},
                             headers=headers(acme, str(uuid.uuid4())))
    assert refund.status_code == 201, refund.text
    assert len(await charges(db, body["reference"])) == 1
    assert await db.fetchval("SELECT refunded_minor FROM payment WHERE id = $1", uuid.UUID(payment["id"])) == 100

    session = await log_in(api)
    assert await db.fetchval("SELECT count(*) FROM console_session WHERE revoked_at IS NULL") == 1
    async with browser(api, session) as operator:
        # The session check passed (on the primary): the page then fails on its read, not with the login form.
        page = await operator.get("/console/parked")
        assert page.status_code == 503, page.status_code
        out = await operator.post("/console/logout")
    assert out.status_code == 303
    assert await db.fetchval("SELECT count(*) FROM console_session WHERE revoked_at IS NULL") == 0


async def test_an_unreachable_read_database_makes_every_page_a_503_never_a_500(http, reads_nowhere, acme):
    """Catches: a page whose read model cannot be reached answering 500 (a bug's answer) instead of 503."""
    paths = (*PAGES, f"/console/payments/{uuid.uuid4()}")
    for path in paths:
        page = await http.get(reads_nowhere.url + path, headers=OPERATOR)
        assert page.status_code == 503, (path, page.status_code, page.text[:200])
        assert page.headers["content-type"] == "application/problem+json", path
        assert page.headers["retry-after"] == "1", path
        assert page.json()["status"] == 503


async def test_the_pages_read_the_read_database_and_a_client_reads_the_primary(http, db, copy, reads_copy, acme):
    """Catches: the console's pages ignoring DATABASE_READ_URL (still reading the primary), or a client's
    GET of its own payment going there (a payment just created answered 404)."""
    await copy.execute("INSERT INTO client (name, api_key_hash) VALUES ('only-in-the-copy', $1)", b"x" * 32)
    created = await http.post(f"{reads_copy.url}/v1/payments", json=payment_body(),
                              headers=headers(acme, str(uuid.uuid4())))
    assert created.status_code == 201, created.text
    pid = created.json()["id"]

    got = await http.get(f"{reads_copy.url}/v1/payments/{pid}", headers=acme.auth)
    assert got.status_code == 200 and got.json()["id"] == pid, "read your writes: on the primary"
    listed = await http.get(reads_copy.url + "/console", headers=OPERATOR)
    assert listed.status_code == 200
    assert "only-in-the-copy (#" in listed.text and "acme (#" not in listed.text, "the clients the copy holds"
    assert pid not in listed.text
    page = await http.get(f"{reads_copy.url}/console/payments/{pid}", headers=OPERATOR)
    assert page.status_code == 404, "the copy has not seen it yet: the page says so"


async def test_a_logout_ends_the_session_at_once_even_where_the_read_database_still_holds_it_open(
        http, db, copy, reads_copy):
    """Catches: opening, checking or revoking a console session on DATABASE_READ_URL (a standby that has not
    yet replayed the logout would keep the session open)."""
    session = await log_in(reads_copy.url)
    assert await copy.fetchval("SELECT count(*) FROM console_session") == 0, "opened on the primary only"
    row = await db.fetchrow("SELECT * FROM console_session")
    # The copy holds the session open, as a standby would before it replays the logout.
    await copy.execute(
        "INSERT INTO console_session (id_hash, token_fingerprint, created_at, expires_at) VALUES ($1, $2, $3, $4)",
        row["id_hash"], row["token_fingerprint"], row["created_at"], row["expires_at"])
    async with browser(reads_copy.url, session) as operator:
        assert (await operator.get("/console/parked")).status_code == 200
        out = await operator.post("/console/logout")
    assert out.status_code == 303
    assert await db.fetchval("SELECT revoked_at IS NOT NULL FROM console_session") is True
    assert await copy.fetchval("SELECT revoked_at IS NULL FROM console_session") is True, "the copy still says open"
    async with browser(reads_copy.url, session) as kept_copy:  # the cookie, kept anywhere
        after = await kept_copy.get("/console/parked")
    assert after.status_code == 401 and 'name="token"' in after.text, "dead at once: checked on the primary"
