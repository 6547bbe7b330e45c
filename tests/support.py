"""Helpers for reading the evidence: our rows, the ledger, the fake rails' records."""

from __future__ import annotations

import asyncio
import time

import asyncpg

from devtools.bodies import IBAN, payment_body  # noqa: F401 (the one payment-body factory, shared with demos and bench)


def headers(client, key: str | None) -> dict[str, str]:
    h = dict(client.auth)
    if key is not None:
        h["Idempotency-Key"] = key
    return h


async def charges(db: asyncpg.Connection, reference: str) -> list[asyncpg.Record]:
    return await db.fetch("SELECT * FROM fake_psp.charge WHERE reference = $1", reference)


async def refunds(db: asyncpg.Connection, reference: str) -> list[asyncpg.Record]:
    return await db.fetch("SELECT * FROM fake_psp.refund WHERE reference = $1", reference)


async def transfers(db: asyncpg.Connection, reference: str) -> list[asyncpg.Record]:
    return await db.fetch("SELECT * FROM fake_rail.transfer WHERE reference = $1", reference)


async def requests_at(db: asyncpg.Connection, service: str, **where: str) -> list[tuple[str, str]]:
    """(method, path) of every request the fake `service` ("psp" or "rail") logged, oldest first.

    `where` filters on the log's columns: idempotency_key (a POST's header, or
    the key a PSP probe looks up), reference, end_to_end_reference.
    """
    assert service in ("psp", "rail") and set(where) <= {"idempotency_key", "reference", "end_to_end_reference"}
    conditions = " AND ".join(f"{column} = ${i}" for i, column in enumerate(where, 1)) or "true"
    rows = await db.fetch(f"SELECT method, path FROM fake_{service}.request WHERE {conditions} ORDER BY seq", *where.values())
    return [(r["method"], r["path"]) for r in rows]


async def key_row(db: asyncpg.Connection, client_id: int, key: str) -> asyncpg.Record | None:
    return await db.fetchrow("SELECT * FROM idempotency_key WHERE client_id = $1 AND key = $2", client_id, key)


async def payments_for(db: asyncpg.Connection, reference: str) -> list[asyncpg.Record]:
    return await db.fetch("SELECT * FROM payment WHERE reference = $1 ORDER BY created_at", reference)


async def ledger(db: asyncpg.Connection, payment_id) -> list[tuple[str, str, int, int]]:
    rows = await db.fetch(
        "SELECT posting, account, debit_minor, credit_minor FROM ledger_entry WHERE payment_id = $1 ORDER BY id",
        payment_id,
    )
    return [tuple(r) for r in rows]


async def unbalanced_payments(db: asyncpg.Connection) -> list[asyncpg.Record]:
    """Every payment whose ledger entries do not sum to zero (there must be none)."""
    return await db.fetch(
        "SELECT payment_id, sum(debit_minor) - sum(credit_minor) AS imbalance "
        "FROM ledger_entry GROUP BY payment_id HAVING sum(debit_minor) <> sum(credit_minor)"
    )


async def event_types(db: asyncpg.Connection, payment_id) -> list[str]:
    """The types of the events written for a payment, oldest first."""
    rows = await db.fetch("SELECT type FROM event WHERE payment_id = $1 ORDER BY id", payment_id)
    return [r["type"] for r in rows]


async def until(condition, what: str, timeout: float = 30.0) -> None:
    """Wait for a durable fact (polling the database), failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def behind_every_running_transaction(db: asyncpg.Connection) -> None:
    """Wait until every event is older than every transaction still running: what the webhook cursor reads."""

    async def older() -> bool:
        return await db.fetchval("SELECT max(written_by) < pg_snapshot_xmin(pg_current_snapshot()) FROM event")

    await until(older, "the events' transactions to be older than every running one")


async def claimed(db: asyncpg.Connection, client_id: int, key: str) -> None:
    """Wait until an attempt has claimed `key` (its Handler1 committed)."""

    async def exists() -> bool:
        return await key_row(db, client_id, key) is not None

    await until(exists, f"key {key!r} to be claimed")
