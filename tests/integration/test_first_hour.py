"""The errors a new user meets in the first hour: one line each, exit 2, with what to do.

Every command that works on DATABASE_URL is run for real (a subprocess)
against a database it cannot use: none listening, one that is not migrated
(a fresh empty database on the tests' server), and a URL that is wrong (not
PostgreSQL, or naming a database that does not exist). Each must answer with
one line on stderr naming the URL without its password, and exit 2. A bad
argument is refused the same way, one line on stderr, before the database
is asked anything.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
from sqlalchemy.engine import make_url

from devtools.processes import BIN, free_port
from tests.conftest import SECRETS_KEY
from devtools.system import System

PASSWORD = "s3cret-first-hour"
COMMANDS = [
    ("breaks",), ("events", "list"), ("keys", "reap", "--dry-run"), ("clients", "create", "acme"),
    ("clients", "reseal-webhook-secrets"), ("reconcile",), ("migrate",),
]
DOWN = f"postgresql://payments:{PASSWORD}@127.0.0.1:1/payments"  # nothing listens on port 1


async def payments(*args: str, database_url: str, **env: str) -> tuple[int, str, str]:
    """`payments <args>` with only DATABASE_URL (and `env`) set: its exit code, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        str(BIN / "payments"), *args,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "DATABASE_URL": database_url} | env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    return process.returncode, out.decode(), err.decode()


async def each(commands, database_url: str) -> list[tuple[tuple[str, ...], int, str, str]]:
    # The key is set for every command: resealing the secrets needs it before it looks at the database.
    results = await asyncio.gather(*(payments(*command, database_url=database_url, WEBHOOK_SECRETS_KEY=SECRETS_KEY)
                                     for command in commands))
    return [(command, *result) for command, result in zip(commands, results)]


def assert_one_line(command, code: int, out: str, err: str, *expected: str) -> None:
    shown = f"payments {' '.join(command)}: exit {code}\nstdout: {out!r}\nstderr: {err!r}"
    assert code == 2, shown
    assert out == "", shown
    assert len(err.splitlines()) == 1, shown
    assert PASSWORD not in err, shown
    for text in expected:
        assert text in err, shown


def with_password(url: str, database: str) -> str:
    return make_url(url).set(database=database, password=PASSWORD).render_as_string(hide_password=False)


async def test_with_the_database_down_each_command_says_so_in_one_line():
    for command, code, out, err in await each(COMMANDS, DOWN):
        assert_one_line(command, code, out, err, "cannot reach the database at postgresql://payments:***@127.0.0.1:1/payments")


@pytest.mark.parametrize("command, expected", [
    (("events", "redeliver", "nope"), "not an event id: 'nope'"),
    (("events", "attempts", "nope"), "not an event id: 'nope'"),
    (("events", "list", "--state", "lost"), "--state is pending, delivered, dead or cancelled"),
    (("reconcile", "--date", "[b]yesterday"), "--date must be YYYY-MM-DD, not '[b]yesterday'"),  # shown as given
    (("clients", "reseal-webhook-secrets"), "WEBHOOK_SECRETS_KEY is not set"),
])
async def test_a_bad_argument_is_refused_in_one_line_on_stderr_before_the_database(command, expected):
    # The database is down: a refusal that looked at it first would name it instead.
    code, out, err = await payments(*command, database_url=DOWN)

    assert_one_line(command, code, out, err, expected)


async def test_on_a_database_not_migrated_each_command_says_to_run_migrate(system: System, server_url: str):
    name = f"first_hour_{uuid.uuid4().hex[:8]}"
    url = with_password(system.create_database(name, migrate=False, drop_at_end=True), name)

    for command, code, out, err in await each([c for c in COMMANDS if c != ("migrate",)], url):
        assert_one_line(command, code, out, err, "is not migrated: run `payments migrate`")


@pytest.mark.parametrize("url, expected", [
    (f"mysql://payments:{PASSWORD}@127.0.0.1/payments", "DATABASE_URL is not a PostgreSQL URL (mysql://...)"),
    ("no-such-database", "does not exist: create it, or fix DATABASE_URL"),
])
async def test_with_a_wrong_url_each_command_says_what_is_wrong(url, expected, server_url: str):
    if url == "no-such-database":
        url = with_password(server_url, f"no_such_database_{uuid.uuid4().hex[:8]}")

    for command, code, out, err in await each(COMMANDS, url):
        assert_one_line(command, code, out, err, expected)


async def test_the_api_says_it_started_and_that_the_database_does_not_answer():
    process = await asyncio.create_subprocess_exec(
        str(BIN / "payments"), "api", "--port", str(free_port()),
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "DATABASE_URL": DOWN,
             "API_METRICS_PORT": str(free_port()), "LOG_FORMAT": "console"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    lines: list[str] = []
    try:
        async def until_the_database_is_named() -> None:
            while line := (await process.stdout.readline()).decode():
                lines.append(line)
                if "cannot reach the database" in line:
                    return

        # Within the start-up probe's bound, with room for a loaded machine: before, nothing came at all.
        await asyncio.wait_for(until_the_database_is_named(), timeout=30)
    finally:
        process.terminate()
        await process.wait()

    said = "".join(lines)
    assert "serving app.main:create_app on http://127.0.0.1:" in said, said
    assert "API process" in said and "started" in said, said
    assert "cannot reach the database at postgresql://payments:***@127.0.0.1:1/payments" in said, said
    assert "/healthz answers 503 until it answers" in said, said
    assert PASSWORD not in said


async def test_a_client_name_already_taken_is_refused_with_the_id_that_has_it(database_url, db):
    code, out, err = await payments("clients", "create", "acme", database_url=database_url)
    assert code == 0, err
    first = await db.fetchval("SELECT id FROM client WHERE name = 'acme'")
    assert f"client {first} (acme)" in out

    code, out, err = await payments("clients", "create", "acme", database_url=database_url)

    assert (code, out) == (2, ""), (code, out, err)
    assert err.splitlines() == [f"a client named 'acme' exists already: id {first}; choose another name "
                                "(or --allow-duplicate-name, then address each by id)"]
    assert await db.fetchval("SELECT count(*) FROM client WHERE name = 'acme'") == 1


async def test_a_name_two_clients_share_is_refused_and_each_is_addressed_by_its_id(database_url, db):
    for _ in range(2):
        code, _, err = await payments("clients", "create", "acme", "--allow-duplicate-name", database_url=database_url)
        assert code == 0, err
    first, second = [r["id"] for r in await db.fetch("SELECT id FROM client WHERE name = 'acme' ORDER BY id")]

    code, out, err = await payments("clients", "set-webhook", "acme", "https://acme.example/webhooks",
                                    database_url=database_url, WEBHOOK_SECRETS_KEY=SECRETS_KEY)

    assert (code, out) == (2, ""), (code, out, err)
    assert err.splitlines() == [f"2 clients are named 'acme' (ids {first}, {second}): give the id instead of the name"]
    assert await db.fetchval("SELECT count(*) FROM webhook_endpoint") == 0  # not the newest, silently

    code, out, err = await payments("clients", "set-webhook", str(first), "https://acme.example/webhooks",
                                    database_url=database_url, WEBHOOK_SECRETS_KEY=SECRETS_KEY)
    assert code == 0, err
    assert [tuple(r) for r in await db.fetch("SELECT client_id, url FROM webhook_endpoint")] == [
        (first, "https://acme.example/webhooks")]
    code, out, err = await payments("clients", "remove-webhook", "acme", database_url=database_url)
    assert code == 2 and "give the id" in err, (code, out, err)
    code, out, err = await payments("clients", "remove-webhook", str(second + 1000), database_url=database_url)
    assert code == 1 and err.splitlines() == [f"no client {second + 1000}"], (code, out, err)


async def test_a_name_of_digits_only_is_refused_as_it_would_read_as_an_id(database_url, db):
    code, out, err = await payments("clients", "create", "42", database_url=database_url)

    assert (code, out) == (2, ""), (code, out, err)
    assert len(err.splitlines()) == 1 and "digits only" in err
    assert await db.fetchval("SELECT count(*) FROM client") == 0
