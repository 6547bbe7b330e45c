"""The recording phases find their payment by its primary key, however young the payment table is.

Each recording phase (app/payments/phases.py) updates the one payment its
key row names. The API's pooled connections keep a statement's generic plan
once PostgreSQL has chosen it, until the next ANALYZE of the table: a plan
chosen while the table was small is kept while it grows. Written as a join
with the fence, the statement was planned as a hash join over a sequential
scan of payment on a fresh database, and a run of a few thousand payments
read the whole table twice per payment, more every round
(docs/reference/performance.md, "Does the database's cost grow within a
run?"). These tests plan every recording statement, generic plan forced, on
a database fresh from migrations (never analyzed, no payments) and fail if
any plan reads payment other than through an index.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator

import asyncpg
import pytest

from app.admin import migrate_database
from app.payments import phases
from app.payments.refunds import phases as refund_phases
from devtools import embedded_db

RECORDING = ("CHARGE_CAPTURED", "CHARGE_DECLINED", "PAYOUT_SENT", "PAYOUT_REJECTED", "CHARGE_REFUNDED")
# A client refund's statements, and the tables each must read by an index only.
REFUND = {"CLAIM_REFUND": ("payment",), "REFUND_SUCCEEDED": ("refund",), "REFUND_FAILED": ("refund", "payment")}


@pytest.fixture(scope="module")
async def young(system, server_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection to a database fresh from migrations: every table empty and never analyzed.

    Made beside the session's database, never in its place: the processes
    later tests start must go on using the session's (`system.create_database`
    would make this one the service's). Its name is this worker's own.
    """
    name = f"payments_plans_{os.getpid()}"
    url = server_url.rsplit("/", 1)[0] + "/" + name
    await asyncio.to_thread(embedded_db.create_database, server_url, name, recreate=True)
    await asyncio.to_thread(migrate_database, url, system.secrets_key)
    conn = await asyncpg.connect(url)
    yield conn
    await conn.close()
    await asyncio.to_thread(embedded_db.drop_database, server_url, name)


def positional(sql: str) -> str:
    """SQLAlchemy's :name parameters as PostgreSQL's $1, $2... (one number per name)."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return re.sub(r"(?<![:\w]):([a-z_][a-z_0-9]*)", number, sql)


def scans(node: dict) -> list[tuple[str, str]]:
    found = [(node["Node Type"], node.get("Relation Name", ""))] if "Scan" in node["Node Type"] else []
    for child in node.get("Plans", []):
        found += scans(child)
    return found


async def generic_plan(young: asyncpg.Connection, sql: str) -> dict:
    async with young.transaction():
        await young.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        await young.execute(f"PREPARE recording AS {positional(sql)}")
        count = await young.fetchval("SELECT cardinality(parameter_types) FROM pg_prepared_statements "
                                     "WHERE name = 'recording'")
        plan = json.loads(await young.fetchval(
            f"EXPLAIN (FORMAT JSON) EXECUTE recording({', '.join(['NULL'] * count)})"))
        await young.execute("DEALLOCATE recording")
    return plan[0]["Plan"]


@pytest.mark.parametrize("name", sorted(REFUND))
async def test_a_refunds_statement_reads_its_payment_and_refund_by_an_index_on_young_tables(young, name):
    found = scans(await generic_plan(young, getattr(refund_phases, name).sql))
    for relation in REFUND[name]:
        on_it = {kind for kind, r in found if r == relation}
        assert on_it and on_it <= {"Index Scan", "Index Only Scan"}, (relation, found)


@pytest.mark.parametrize("name", RECORDING)
async def test_a_recording_phase_reads_payment_by_its_primary_key_on_a_young_table(young, name):
    statement = getattr(phases, name)
    async with young.transaction():
        await young.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        await young.execute(f"PREPARE recording AS {positional(statement.sql)}")
        count = await young.fetchval("SELECT cardinality(parameter_types) FROM pg_prepared_statements "
                                     "WHERE name = 'recording'")
        plan = json.loads(await young.fetchval(
            f"EXPLAIN (FORMAT JSON) EXECUTE recording({', '.join(['NULL'] * count)})"))
        await young.execute("DEALLOCATE recording")
    on_payment = [kind for kind, relation in scans(plan[0]["Plan"]) if relation == "payment"]
    assert on_payment == ["Index Scan"], on_payment
