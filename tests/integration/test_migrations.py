"""Each migration upgrades a database that holds data from the revision before it.

A landed migration is never edited, and production databases are never
empty: so each new revision is tested by building the schema at the previous
head, writing rows as the code of that time wrote them, upgrading, and
checking that every row survived and reads as the new code expects.
"""

from __future__ import annotations

import os
import uuid
from datetime import UTC, datetime, timedelta
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import asyncpg
import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy.ext.asyncio import create_async_engine

from app.config import asyncpg_url
from app.db.transaction import one_statement, read
from app.outbox import delivery
from app.outbox.endpoints import new_secret
from app.outbox.sealing import SecretsKey
from app.payments import payment_table
from devtools import embedded_db
from tests.conftest import SECRETS_KEY
from tests.support import behind_every_running_transaction

ROOT = Path(__file__).resolve().parents[2]


def _upgrade(url: str, revision: str) -> None:
    config = Config(str(ROOT / "alembic.ini"))
    config.attributes["database_url"] = url
    command.upgrade(config, revision)


@pytest.fixture
async def scratch(server_url: str):
    """An empty database of this test's own."""
    name = f"payments_migrate_{os.getpid()}"
    url = server_url.rsplit("/", 1)[0] + "/" + name
    with ThreadPoolExecutor(1) as pool:
        pool.submit(embedded_db.create_database, server_url, name, recreate=True).result()
    yield url
    with ThreadPoolExecutor(1) as pool:
        pool.submit(embedded_db.drop_database, server_url, name).result()


async def migrate(url: str, revision: str) -> None:
    # Alembic's env.py runs its own event loop, which cannot nest in ours.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(_upgrade, url, revision).result()


async def insert_payment(conn: asyncpg.Connection, payment_id: uuid.UUID, client: int, reference: str, status: str) -> None:
    """A payment row as every revision since 0001 has it."""
    await conn.execute(
        "INSERT INTO payment (id, client_id, reference, amount_minor, currency, fee_minor, net_minor, "
        "card_token, beneficiary_name, beneficiary_iban, status) "
        "VALUES ($1, $2, $3, 1250, 'EUR', 43, 1207, 'tok_visa', 'Ada', 'DE89370400440532013000', $4)",
        payment_id, client, reference, status,
    )


async def test_0004_keeps_every_key_row_and_marks_none_as_not_sent(scratch):
    await migrate(scratch, "0003")
    conn = await asyncpg.connect(scratch)
    try:
        client = await conn.fetchval("INSERT INTO client (name, api_key_hash) VALUES ('c', 'h') RETURNING id")
        rows = {"finished": uuid.uuid4(), "parked": uuid.uuid4(), "released": uuid.uuid4()}
        for state, payment_id in rows.items():
            status = {"finished": "succeeded", "parked": "indeterminate", "released": "processing"}[state]
            await insert_payment(conn, payment_id, client, f"order-{state}", status)
            await conn.execute(
                "INSERT INTO idempotency_key (client_id, key, endpoint, request_hash, state, recovery_point, "
                "payment_id, parked_at, response_code, response_body) "
                "VALUES ($1, $2, 'POST /v1/payments', 'x', $3, $4, $5, $6, $7, $8)",
                client, f"key-{state}", "finished" if state == "finished" else "started",
                "finished" if state == "finished" else "EXT1_SENT", payment_id,
                None if state != "parked" else await conn.fetchval("SELECT now()"),
                201 if state == "finished" else None, "{}" if state == "finished" else None,
            )
        before = await conn.fetch("SELECT * FROM idempotency_key ORDER BY key")
    finally:
        await conn.close()

    await migrate(scratch, "0004")

    conn = await asyncpg.connect(scratch)
    try:
        after = await conn.fetch("SELECT * FROM idempotency_key ORDER BY key")
        assert [dict(r) for r in before] == [
            {k: v for k, v in dict(r).items() if k != "not_sent"} for r in after
        ], "every row and every column kept"
        assert [r["not_sent"] for r in after] == [False, False, False], "nobody claimed anything unsent"
        assert await conn.fetchval(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = 'idempotency_key_parked'::regclass"
        ), "the concurrently built index is valid"
    finally:
        await conn.close()


async def test_0005_keeps_every_key_row_caps_stored_responses_and_indexes_payment_id(scratch):
    await migrate(scratch, "0004")
    conn = await asyncpg.connect(scratch)
    try:
        client = await conn.fetchval("INSERT INTO client (name, api_key_hash) VALUES ('c', 'h') RETURNING id")
        payment_id = uuid.uuid4()
        await insert_payment(conn, payment_id, client, "order-1", "succeeded")
        await conn.execute(
            "INSERT INTO idempotency_key (client_id, key, endpoint, request_hash, state, recovery_point, "
            "payment_id, response_code, response_body) "
            "VALUES ($1, 'k', 'POST /v1/payments', 'x', 'finished', 'finished', $2, 201, $3)",
            client, payment_id, '{"id": "a stored response of a realistic size"}' + " " * 900,
        )
        before = await conn.fetch("SELECT * FROM idempotency_key")
    finally:
        await conn.close()

    await migrate(scratch, "0005")

    conn = await asyncpg.connect(scratch)
    try:
        assert [dict(r) for r in await conn.fetch("SELECT * FROM idempotency_key")] == [dict(r) for r in before]
        validated = await conn.fetchval(
            "SELECT convalidated FROM pg_constraint WHERE conname = 'idempotency_key_response_body_capped'"
        )
        assert validated, "the cap holds for the rows already there, not only new ones"
        assert await conn.fetchval(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = 'idempotency_key_payment_id'::regclass"
        )
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute(
                "UPDATE idempotency_key SET response_body = $1 WHERE key = 'k'", "x" * 4097
            )
    finally:
        await conn.close()


async def test_0006_partitions_the_key_table_keeping_every_row_and_answer_in_place(scratch):
    await migrate(scratch, "0005")
    conn = await asyncpg.connect(scratch)
    try:
        client = await conn.fetchval("INSERT INTO client (name, api_key_hash) VALUES ('c', 'h') RETURNING id")
        now = await conn.fetchval("SELECT now()")
        for state, status in (("finished", "succeeded"), ("started", "processing"), ("parked", "indeterminate")):
            payment_id = uuid.uuid4()
            await insert_payment(conn, payment_id, client, f"order-{state}", status)
            await conn.execute(
                "INSERT INTO idempotency_key (client_id, key, endpoint, request_hash, state, recovery_point, "
                "payment_id, lease_token, lease_expires_at, parked_at, response_code, response_body, finished_at) "
                "VALUES ($1, $2, 'POST /v1/payments', 'x', $3, $4, $5, $6, $7, $8, $9, $10, $11)",
                client, f"key-{state}", "finished" if state == "finished" else "started",
                "finished" if state == "finished" else "EXT2_SENT", payment_id,
                uuid.uuid4() if state == "started" else None,
                now + timedelta(seconds=30) if state == "started" else None,
                now if state == "parked" else None,
                201 if state == "finished" else None,
                '{"id": "the stored answer"}' if state == "finished" else None,
                now if state == "finished" else None,
            )
        before = await conn.fetch("SELECT * FROM idempotency_key ORDER BY key")
        day = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
    finally:
        await conn.close()

    await migrate(scratch, "0006")

    conn = await asyncpg.connect(scratch)
    try:
        after = await conn.fetch("SELECT tableoid::regclass::text AS partition, * FROM idempotency_key ORDER BY key")
        assert [dict(r) for r in before] == [
            {k: v for k, v in dict(r).items() if k not in ("partition", "stored_on")} for r in after
        ], "every row, every column and every stored answer kept"
        assert {(r["partition"], r["stored_on"]) for r in after} == {("idempotency_key_legacy", day)}
        assert await conn.fetchval("SELECT relkind::text FROM pg_class WHERE oid = 'idempotency_key'::regclass") == "p"
        bounds = await conn.fetch(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) AS bound FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'idempotency_key'::regclass AND c.relkind = 'r'"
        )
        names = {r["relname"] for r in bounds}
        assert names == {"idempotency_key_legacy"} | {
            f"idempotency_key_p{day + timedelta(days=n):%Y%m%d}" for n in range(1, 8)
        }, "the day of the migration in the legacy partition, the next seven days ahead"
        # The old table's indexes were adopted, not rebuilt beside new ones.
        legacy_indexes = await conn.fetch(
            "SELECT indexrelid::regclass::text AS name FROM pg_index WHERE indrelid = 'idempotency_key_legacy'::regclass"
        )
        assert sorted(r["name"] for r in legacy_indexes) == [
            "idempotency_key_legacy_parked", "idempotency_key_legacy_payment_id",
            "idempotency_key_legacy_pkey", "idempotency_key_legacy_unfinished",
        ]
        # A claim finds every existing key (no second row), and claims a new one.
        for key in ("key-finished", "key-started", "key-parked"):
            assert await conn.fetchval(
                "SELECT claim_idempotency_key($1, $2, 'POST /v1/payments', 'x', 'EXT1_SENT', NULL, 30)", client, key
            ) is None
        assert await conn.fetchval(
            "SELECT claim_idempotency_key($1, 'key-new', 'POST /v1/payments', 'x', 'EXT1_SENT', NULL, 30)", client
        ) is not None
        assert await conn.fetchval("SELECT count(*) FROM idempotency_key") == 4
    finally:
        await conn.close()


def revision_before(revision: str) -> str:
    """The revision `revision` upgrades from, as its file says (so the test follows a re-pointed migration)."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(Config(str(ROOT / "alembic.ini")))
    down = script.get_revision(revision).down_revision
    assert isinstance(down, str), "one previous revision"
    return down


async def test_0007_keeps_every_payment_and_key_row_and_gives_old_payments_room_for_events(scratch):
    previous = revision_before("0007")
    await migrate(scratch, previous)
    conn = await asyncpg.connect(scratch)
    try:
        client = await conn.fetchval("INSERT INTO client (name, api_key_hash) VALUES ('c', 'h') RETURNING id")
        payment_id = uuid.uuid4()
        await insert_payment(conn, payment_id, client, "order-1", "succeeded")
        await conn.execute(
            "INSERT INTO idempotency_key (client_id, key, endpoint, request_hash, state, recovery_point, "
            "payment_id, response_code, response_body) "
            "VALUES ($1, 'k', 'POST /v1/payments', 'x', 'finished', 'finished', $2, 201, '{}')",
            client, payment_id,
        )
        before = {t: await conn.fetch(f"SELECT * FROM {t}") for t in ("client", "payment", "idempotency_key")}
    finally:
        await conn.close()

    await migrate(scratch, "0007")

    conn = await asyncpg.connect(scratch)
    try:
        for table, rows in before.items():
            assert [dict(r) for r in await conn.fetch(f"SELECT * FROM {table}")] == [dict(r) for r in rows], table
        for table in ("event", "webhook_endpoint", "webhook_delivery", "webhook_attempt"):
            assert await conn.fetchval(f"SELECT count(*) FROM {table}") == 0, "nothing invented for the past"
        # A payment from before the upgrade can have events from now on.
        event_id = await conn.fetchval(
            "INSERT INTO event (client_id, payment_id, type, data) VALUES ($1, $2, 'payment.returned', '{}') RETURNING id",
            client, payment_id,
        )
        assert event_id.version == 7
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute(
                "INSERT INTO event (client_id, payment_id, type, data) VALUES ($1, $2, 'not a type', '{}')",
                client, payment_id,
            )
    finally:
        await conn.close()


async def test_0008_keeps_every_payment_and_break_and_lets_a_paid_out_payment_be_returned(scratch):
    await migrate(scratch, "0007")
    conn = await asyncpg.connect(scratch)
    try:
        client = await conn.fetchval("INSERT INTO client (name, api_key_hash) VALUES ('c', 'h') RETURNING id")
        statuses = ("processing", "succeeded", "declined", "failed", "indeterminate")
        for status in statuses:
            await insert_payment(conn, uuid.uuid4(), client, f"order-{status}", status)
        await conn.execute(
            "INSERT INTO reconciliation_break (window_start, kind, end_to_end_reference, details) "
            "VALUES ('2026-12-01', 'unmatched_transfer', 'E2E1', '{}')"
        )
        before = {t: await conn.fetch(f"SELECT * FROM {t} ORDER BY 1") for t in ("payment", "reconciliation_break")}
    finally:
        await conn.close()

    await migrate(scratch, "0008")

    conn = await asyncpg.connect(scratch)
    try:
        after = {t: await conn.fetch(f"SELECT * FROM {t} ORDER BY 1") for t in before}
        new_columns = {"return_id", "return_reason", "returned_at"}
        assert [{k: v for k, v in r.items() if k not in new_columns} for r in after["payment"]] == [
            dict(r) for r in before["payment"]
        ]
        assert all(r[c] is None for r in after["payment"] for c in new_columns), "nothing invented for the past"
        assert [dict(r) for r in after["reconciliation_break"]] == [dict(r) for r in before["reconciliation_break"]]
        # An old, paid-out payment can be returned and refunded from now on; nothing else is a status.
        await conn.execute("UPDATE payment SET status = 'returned', return_id = 'rt_1' WHERE reference = 'order-succeeded'")
        await conn.execute("UPDATE payment SET status = 'refunded' WHERE reference = 'order-succeeded'")
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute("UPDATE payment SET status = 'recalled' WHERE reference = 'order-failed'")
        await conn.execute(
            "INSERT INTO reconciliation_break (window_start, kind, end_to_end_reference, details) "
            "VALUES ('2026-12-02', 'unmatched_return', 'E2E2', '{}')"
        )
        await conn.execute(
            "INSERT INTO rail_message (inbox_key, source, message_id, return_id, end_to_end_reference, "
            "reason_code, outcome, body) VALUES ('return:rt_2', 'notification', 'msg_2', 'rt_2', 'E2E2', 'AC04', "
            "'unmatched', '{}')"
        )
        with pytest.raises(asyncpg.UniqueViolationError):  # the inbox: one row per return
            await conn.execute(
                "INSERT INTO rail_message (inbox_key, source, return_id, end_to_end_reference, reason_code, "
                "outcome, body) VALUES ('return:rt_2', 'statement', 'rt_2', 'E2E2', 'AC04', 'unmatched', '{}')"
            )
    finally:
        await conn.close()


async def test_0009_seals_every_plaintext_webhook_secret_and_refuses_without_the_key(scratch):
    from cryptography.fernet import Fernet

    from app.admin import MigrationRefused, migrate_database

    previous = revision_before("0009")
    await migrate(scratch, previous)
    conn = await asyncpg.connect(scratch)
    plaintext = {}
    try:
        for n in range(3):
            client = await conn.fetchval(f"INSERT INTO client (name, api_key_hash) VALUES ('c{n}', 'h{n}') RETURNING id")
            plaintext[client] = f"whsec_{'ABCD' * 8}{n}="[:50]
            await conn.execute("INSERT INTO webhook_endpoint (client_id, url, secret) VALUES ($1, $2, $3)",
                               client, f"https://merchant{n}.example/hooks", plaintext[client])
        before = await conn.fetch("SELECT client_id, url, created_at FROM webhook_endpoint ORDER BY client_id")
    finally:
        await conn.close()

    # Rows to seal and no key: refused, and nothing changed.
    def upgrade(key):
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(migrate_database, scratch, key).result()

    with pytest.raises(MigrationRefused, match="3 webhook signing secrets must be sealed with WEBHOOK_SECRETS_KEY"):
        upgrade(None)
    conn = await asyncpg.connect(scratch)
    try:
        assert await conn.fetchval("SELECT version_num FROM alembic_version") == previous
        assert {r["client_id"]: r["secret"] for r in await conn.fetch("SELECT * FROM webhook_endpoint")} == plaintext
    finally:
        await conn.close()

    key = Fernet.generate_key().decode()
    upgrade(f"{key},{Fernet.generate_key().decode()}")  # the first key of a list seals

    conn = await asyncpg.connect(scratch)
    try:
        after = await conn.fetch("SELECT * FROM webhook_endpoint ORDER BY client_id")
        assert [(r["client_id"], r["url"], r["created_at"]) for r in after] == [tuple(r) for r in before]
        assert "secret" not in after[0].keys(), "the plaintext column is gone"
        assert {r["client_id"]: Fernet(key).decrypt(r["secret_sealed"].encode()).decode() for r in after} == plaintext
        assert all(r["previous_secret_sealed"] is None and r["previous_secret_until"] is None for r in after)
        with pytest.raises(asyncpg.CheckViolationError):  # never a secret in the clear again
            await conn.execute("UPDATE webhook_endpoint SET secret_sealed = 'whsec_AAAA'")
    finally:
        await conn.close()


async def test_0009_needs_no_key_when_there_is_no_secret_to_seal(scratch):
    await migrate(scratch, revision_before("0009"))
    await migrate(scratch, "0009")
    conn = await asyncpg.connect(scratch)
    try:
        columns = {r["column_name"] for r in await conn.fetch(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'webhook_endpoint'")}
        assert {"secret_sealed", "previous_secret_sealed", "previous_secret_until"} <= columns
        assert "secret" not in columns
    finally:
        await conn.close()


async def test_0010_adds_console_sessions_beside_every_row_of_the_previous_head(scratch):
    from cryptography.fernet import Fernet

    previous = revision_before("0010")
    await migrate(scratch, previous)
    conn = await asyncpg.connect(scratch)
    try:
        client = await conn.fetchval("INSERT INTO client (name, api_key_hash) VALUES ('c', 'h') RETURNING id")
        await insert_payment(conn, uuid.uuid4(), client, "order-1", "succeeded")
        key = Fernet.generate_key().decode()
        await conn.execute("INSERT INTO webhook_endpoint (client_id, url, secret_sealed) VALUES ($1, $2, $3)",
                           client, "https://merchant.example/hooks",
                           Fernet(key).encrypt(b"whsec_" + b"A" * 32).decode())
        tables = ("client", "payment", "webhook_endpoint")
        before = {t: [dict(r) for r in await conn.fetch(f"SELECT * FROM {t} ORDER BY 1")] for t in tables}
    finally:
        await conn.close()

    await migrate(scratch, "0010")

    conn = await asyncpg.connect(scratch)
    try:
        assert {t: [dict(r) for r in await conn.fetch(f"SELECT * FROM {t} ORDER BY 1")] for t in tables} == before
        assert await conn.fetchval("SELECT count(*) FROM console_session") == 0, "no session invented"
        digest = b"\x01" * 32
        await conn.execute("INSERT INTO console_session (id_hash, token_fingerprint, expires_at) "
                           "VALUES ($1, $1, now() + interval '1 hour')", digest)
        row = await conn.fetchrow("SELECT * FROM console_session")
        assert row["revoked_at"] is None and row["expires_at"] - row["created_at"] == timedelta(hours=1)
        with pytest.raises(asyncpg.UniqueViolationError):
            await conn.execute("INSERT INTO console_session (id_hash, token_fingerprint, expires_at) "
                               "VALUES ($1, $1, now() + interval '1 hour')", digest)
        with pytest.raises(asyncpg.CheckViolationError):  # only a SHA-256 is stored, never the id itself
            await conn.execute("INSERT INTO console_session (id_hash, token_fingerprint, expires_at) "
                               "VALUES ('raw-session-id', $1, now() + interval '1 hour')", digest)
    finally:
        await conn.close()


STATUSES = ("processing", "succeeded", "declined", "failed", "indeterminate", "returned", "refunded")


async def insert_one_payment_of_each_status(conn: asyncpg.Connection, client: int) -> None:
    """A payment in every status, with the reference order-<status>."""
    for status in STATUSES:
        await insert_payment(conn, uuid.uuid4(), client, f"order-{status}", status)


async def test_0011_gives_every_payment_its_refunded_amount_and_guards_it_by_a_constraint(scratch):
    await migrate(scratch, revision_before("0011"))
    conn = await asyncpg.connect(scratch)
    try:
        client = await conn.fetchval("INSERT INTO client (name, api_key_hash) VALUES ('c', 'h') RETURNING id")
        await insert_one_payment_of_each_status(conn, client)
        before = [dict(r) for r in await conn.fetch("SELECT * FROM payment ORDER BY reference")]
    finally:
        await conn.close()

    await migrate(scratch, "0011")

    conn = await asyncpg.connect(scratch)
    try:
        after = [dict(r) for r in await conn.fetch("SELECT * FROM payment ORDER BY reference")]
        new_columns = {"refunded_minor", "return_refund_minor"}
        assert [{k: v for k, v in r.items() if k not in new_columns} for r in after] == before
        refunded = {r["status"]: (r["refunded_minor"], r["return_refund_minor"]) for r in after}
        # What our compensations refunded in full before client refunds existed; nothing else refunded.
        assert refunded == {
            "processing": (0, None), "succeeded": (0, None), "declined": (0, None), "indeterminate": (0, None),
            "failed": (1250, None), "returned": (1250, 1250), "refunded": (1250, 1250),
        }
        with pytest.raises(asyncpg.CheckViolationError):  # the last line of defence against an over-refund
            await conn.execute("UPDATE payment SET refunded_minor = amount_minor + 1 WHERE reference = 'order-succeeded'")
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute("UPDATE payment SET refunded_minor = -1 WHERE reference = 'order-succeeded'")
        payment = await conn.fetchval("SELECT id FROM payment WHERE reference = 'order-succeeded'")
        insert = (
            "INSERT INTO refund (id, payment_id, client_id, idempotency_key, reference, amount_minor, currency, "
            "status, psp_charge_id, psp_refund_key, finished_at) "
            "VALUES ($1, $2, $3, $4, 'rma-1', 100, 'EUR', $5, 'ch_1', 'k5', $6)"
        )
        await conn.execute(insert, uuid.uuid4(), payment, client, "k-1", "failed", datetime.now(UTC))
        await conn.execute(insert, uuid.uuid4(), payment, client, "k-2", "pending", None)  # a failed one frees it
        with pytest.raises(asyncpg.UniqueViolationError):  # the business identity: one live refund per reference
            await conn.execute(insert, uuid.uuid4(), payment, client, "k-3", "succeeded", datetime.now(UTC))
        with pytest.raises(asyncpg.CheckViolationError):  # a pending refund is not finished, a final one is
            await conn.execute(insert.replace("'rma-1'", "'rma-2'"), uuid.uuid4(), payment, client, "k-4", "pending",
                               datetime.now(UTC))
    finally:
        await conn.close()


async def test_0012_keeps_every_payment_and_event_and_lets_a_batch_event_name_no_payment(scratch):
    await migrate(scratch, revision_before("0012"))
    conn = await asyncpg.connect(scratch)
    try:
        client = await conn.fetchval("INSERT INTO client (name, api_key_hash) VALUES ('c', 'h') RETURNING id")
        payment = uuid.uuid4()
        await insert_payment(conn, payment, client, "order-1", "succeeded")
        await conn.execute("INSERT INTO event (client_id, payment_id, type, data) VALUES ($1, $2, 'payment.succeeded', '{}')",
                           client, payment)
        before = ([dict(r) for r in await conn.fetch("SELECT * FROM payment")],
                  [dict(r) for r in await conn.fetch("SELECT * FROM event")])
        with pytest.raises(asyncpg.NotNullViolationError):  # before: every event names a payment
            await conn.execute("INSERT INTO event (client_id, type, data) VALUES ($1, 'batch.completed', '{}')", client)
    finally:
        await conn.close()

    await migrate(scratch, "0012")

    conn = await asyncpg.connect(scratch)
    try:
        after = ([dict(r) for r in await conn.fetch("SELECT * FROM payment")],
                 [dict(r) for r in await conn.fetch("SELECT * FROM event")])
        assert after == before
        await conn.execute("INSERT INTO event (client_id, type, data) VALUES ($1, 'batch.completed', '{}')", client)
        batch = uuid.uuid4()
        await conn.execute("INSERT INTO payment_batch (id, client_id, reference, idempotency_key, row_count)"
                           " VALUES ($1, $2, 'payroll', 'k', 1)", batch, client)
        await conn.execute("INSERT INTO payment_batch_row (batch_id, row_number, client_id, row_key, reference, value_date,"
                           " request, payment_id) VALUES ($1, 1, $2, $3, 'emp-1', '2026-12-24', '{}', $4)",
                           batch, client, uuid.uuid4(), payment)
        await conn.execute("INSERT INTO batch_outbox (batch_id, row_number) VALUES ($1, 1)", batch)
        with pytest.raises(asyncpg.ForeignKeyViolationError):  # an outbox row is always a row's
            await conn.execute("INSERT INTO batch_outbox (batch_id, row_number) VALUES ($1, 2)", batch)
    finally:
        await conn.close()


async def test_0013_keeps_every_row_drops_the_keys_into_client_and_refuses_to_delete_a_client(scratch):
    await migrate(scratch, revision_before("0013"))
    conn = await asyncpg.connect(scratch)
    try:
        client = await conn.fetchval("INSERT INTO client (name, api_key_hash) VALUES ('c', 'h') RETURNING id")
        idle = await conn.fetchval("INSERT INTO client (name, api_key_hash) VALUES ('idle', 'h2') RETURNING id")
        payment = uuid.uuid4()
        await insert_payment(conn, payment, client, "order-1", "succeeded")
        await conn.execute("INSERT INTO idempotency_key (client_id, key, endpoint, request_hash, state, recovery_point,"
                           " payment_id) VALUES ($1, 'k1', 'POST /v1/payments', '\\x00', 'started', 'EXT1_SENT', $2)",
                           client, payment)
        await conn.execute("INSERT INTO event (client_id, payment_id, type, data) VALUES ($1, $2, 'payment.succeeded', '{}')",
                           client, payment)
        tables = ("client", "payment", "idempotency_key", "event")
        before = {t: await every_row(conn, t) for t in tables}
        with pytest.raises(asyncpg.ForeignKeyViolationError):  # before: a payment must name a client that exists
            await insert_payment(conn, uuid.uuid4(), client + 1000, "order-2", "succeeded")
    finally:
        await conn.close()

    await migrate(scratch, "0013")

    conn = await asyncpg.connect(scratch)
    try:
        assert {t: [dict(r) for r in await conn.fetch(f"SELECT * FROM {t} ORDER BY 1, 2")] for t in tables} == before
        # Bug caught: a foreign key into client left on a table written per
        # operation (every partition of the key table included).
        referencing = await conn.fetch(
            "SELECT conrelid::regclass::text AS tab FROM pg_constraint WHERE contype = 'f' AND confrelid = 'client'::regclass"
        )
        assert {r["tab"] for r in referencing} == {"webhook_endpoint"}, referencing
        # Bug caught: a client that can be deleted, now that no key stops it,
        # leaving its payments naming nobody; or one without rows still deletable.
        for who in (client, idle):
            with pytest.raises(asyncpg.RestrictViolationError, match="never deleted"):
                await conn.execute("DELETE FROM client WHERE id = $1", who)
        assert await conn.fetchval("SELECT count(*) FROM client") == 2
    finally:
        await conn.close()


async def test_0014_keeps_every_payment_frees_the_references_of_ended_ones_and_indexes_no_status(scratch):
    await migrate(scratch, revision_before("0014"))
    conn = await asyncpg.connect(scratch)
    try:
        client = await conn.fetchval("INSERT INTO client (name, api_key_hash) VALUES ('c', 'h') RETURNING id")
        await insert_one_payment_of_each_status(conn, client)
        # A parked payout, as reconciliation must still find it: its key row parked at EXT2_SENT.
        parked = await conn.fetchval("SELECT id FROM payment WHERE status = 'indeterminate'")
        await conn.execute("UPDATE payment SET payout_instructed_at = now(), end_to_end_reference = 'E2E1' "
                           "WHERE id = $1", parked)
        await conn.execute("INSERT INTO idempotency_key (client_id, key, endpoint, request_hash, state, recovery_point,"
                           " payment_id, parked_at) VALUES ($1, 'k1', 'POST /v1/payments', '\\x00', 'started', "
                           "'EXT2_SENT', $2, now())", client, parked)
        before = [dict(r) for r in await conn.fetch("SELECT * FROM payment ORDER BY reference")]
    finally:
        await conn.close()

    await migrate(scratch, "0014")

    conn = await asyncpg.connect(scratch)
    try:
        after = [dict(r) for r in await conn.fetch("SELECT * FROM payment ORDER BY reference")]
        assert [{k: v for k, v in r.items() if k != "holds_reference"} for r in after] == before
        # Bug caught: a backfill that frees the reference of a payment that
        # moved money (a second payment of a paid order would be accepted),
        # or keeps a declined order's reference (it could never be paid again).
        assert {r["status"]: r["holds_reference"] for r in after} == {
            "processing": True, "succeeded": True, "declined": False, "failed": False, "indeterminate": True,
            "returned": True, "refunded": True,
        }
        with pytest.raises(asyncpg.UniqueViolationError):  # the order paid is still the only one in force
            await insert_payment(conn, uuid.uuid4(), client, "order-succeeded", "processing")
        await insert_payment(conn, uuid.uuid4(), client, "order-declined", "processing")  # a declined order again
        with pytest.raises(asyncpg.CheckViolationError):  # a status change that forgets the reference is refused
            await conn.execute("UPDATE payment SET status = 'declined' WHERE reference = 'order-processing'")
        # No index of payment names status or the payout's instruction time,
        # so the updates on the way to `succeeded` can be HOT.
        indexed = await conn.fetch(
            "SELECT indexrelid::regclass::text AS name, pg_get_indexdef(indexrelid) AS def "
            "FROM pg_index WHERE indrelid = 'payment'::regclass"
        )
        assert {r["name"] for r in indexed} == {
            "payment_pkey", "payment_end_to_end_reference_key", "payment_reference_in_force"
        }
        assert not [r["def"] for r in indexed if "status" in r["def"] or "payout_instructed_at" in r["def"]]
        assert await conn.fetchval("SELECT bool_and(indisvalid) FROM pg_index WHERE indrelid = 'payment'::regclass")
    finally:
        await conn.close()
    # Bug caught: reconciliation, which found parked payouts through the
    # dropped index of parked payments, no longer finding them.
    engine = create_async_engine(asyncpg_url(scratch))
    try:
        today = datetime.now(UTC).date()
        found = await read(engine, payment_table.parked_payouts, today - timedelta(days=1), today + timedelta(days=1))
    finally:
        await engine.dispose()
    assert [(payment.id, key) for payment, key in found] == [(parked, "k1")]


async def test_0015_keeps_every_key_row_and_its_claims_look_up_to_tomorrow_only(scratch):
    await migrate(scratch, revision_before("0015"))
    conn = await asyncpg.connect(scratch)
    try:
        client = await conn.fetchval("INSERT INTO client (name, api_key_hash) VALUES ('c', 'h') RETURNING id")
        await conn.execute("INSERT INTO idempotency_key (client_id, key, endpoint, request_hash, state, recovery_point)"
                           " VALUES ($1, 'k-old', 'POST /v1/payments', '\\x00', 'started', 'EXT1_SENT')", client)
        before = [dict(r) for r in await conn.fetch("SELECT * FROM idempotency_key ORDER BY key")]
    finally:
        await conn.close()

    await migrate(scratch, "0015")

    # A claim with no payment (NULL): what the look finds is all this is about.
    claim = "SELECT claim_idempotency_key($1, $2, 'POST /v1/payments', '\\x00', 'EXT1_SENT', NULL, 30)"
    conn = await asyncpg.connect(scratch)
    try:
        assert [dict(r) for r in await conn.fetch("SELECT * FROM idempotency_key ORDER BY key")] == before
        today = await conn.fetchval("SELECT key_table_day()")
        assert await conn.fetchval("SELECT key_table_last_day()") == today + timedelta(days=1)
        # The key that exists is found (no second row), a new one is claimed.
        assert await conn.fetchval(claim, client, "k-old") is None
        assert await conn.fetchval(claim, client, "k-new") is not None
        assert await conn.fetchval("SELECT count(*) FROM idempotency_key WHERE key = 'k-old'") == 1
        # A row stored after tomorrow is one the bound says cannot exist: the
        # look does not reach it (which is what spares the days ahead).
        later = today + timedelta(days=3)
        await conn.execute("UPDATE idempotency_key SET stored_on = $1 WHERE key = 'k-new'", later)
        assert await conn.fetchval(claim, client, "k-new") is not None
    finally:
        await conn.close()


def _downgrade(url: str, revision: str) -> None:
    config = Config(str(ROOT / "alembic.ini"))
    config.attributes["database_url"] = url
    command.downgrade(config, revision)


async def downgrade(url: str, revision: str) -> None:
    with ThreadPoolExecutor(1) as pool:  # as `migrate`: Alembic's loop cannot nest in ours
        pool.submit(_downgrade, url, revision).result()


async def insert_event_of_a_client_with_an_endpoint(conn: asyncpg.Connection) -> tuple[int, uuid.UUID, uuid.UUID]:
    """A client whose webhook endpoint is https://example.com/hook, a succeeded payment of theirs and its event,
    as every revision since 0007 has them: the client's, the payment's and the event's ids."""
    client = await conn.fetchval("INSERT INTO client (name, api_key_hash) VALUES ('c', 'h') RETURNING id")
    await conn.execute("INSERT INTO webhook_endpoint (client_id, url, secret_sealed) "
                       "VALUES ($1, 'https://example.com/hook', 'sealed')", client)
    payment_id = uuid.uuid4()
    await insert_payment(conn, payment_id, client, "r-1", "succeeded")
    event_id = await conn.fetchval("INSERT INTO event (client_id, payment_id, type, data) "
                                   "VALUES ($1, $2, 'payment.succeeded', '{}') RETURNING id", client, payment_id)
    return client, payment_id, event_id


async def test_0016_keeps_every_event_and_delivery_and_reads_only_new_events_behind_the_cursor(scratch):
    await migrate(scratch, revision_before("0016"))
    conn = await asyncpg.connect(scratch)
    try:
        # As the previous revision's phase wrote them: the event and its pending delivery.
        client, payment_id, old = await insert_event_of_a_client_with_an_endpoint(conn)
        await conn.execute("INSERT INTO webhook_delivery (event_id, client_id) VALUES ($1, $2)", old, client)
        before = [dict(r) for r in await conn.fetch("SELECT * FROM event ORDER BY id")]
        deliveries = [dict(r) for r in await conn.fetch("SELECT * FROM webhook_delivery")]
    finally:
        await conn.close()

    await migrate(scratch, "0016")

    conn = await asyncpg.connect(scratch)
    try:
        after = [dict(r) for r in await conn.fetch("SELECT * FROM event ORDER BY id")]
        assert [{k: v for k, v in r.items() if k != "written_by"} for r in after] == before
        assert [r["written_by"] for r in after] == [None], "an old event is not the cursor's: its row delivers it"
        assert [dict(r) for r in await conn.fetch("SELECT * FROM webhook_delivery")] == deliveries
        cursor = await conn.fetchrow("SELECT written_by::text, event_id, lease_token FROM webhook_cursor")
        assert tuple(cursor) == ("0", uuid.UUID(int=0), None)
        valid = await conn.fetchval("SELECT indisvalid FROM pg_index WHERE indexrelid = 'event_written_by'::regclass")
        assert valid
        # A new event carries the transaction that wrote it.
        new = await conn.fetchval("INSERT INTO event (client_id, payment_id, type, data) "
                                  "VALUES ($1, $2, 'payment.refunded', '{}') RETURNING id", client, payment_id)
        assert await conn.fetchval("SELECT written_by IS NOT NULL FROM event WHERE id = $1", new)
    finally:
        await conn.close()

    # Back to the previous revision, whose dispatcher reads delivery rows only:
    # the new event, still ahead of the cursor, gets its row; the old keeps its own.
    await downgrade(scratch, revision_before("0016"))
    conn = await asyncpg.connect(scratch)
    try:
        rows = {r["event_id"]: r["state"] for r in await conn.fetch("SELECT event_id, state FROM webhook_delivery")}
        assert rows == {old: "pending", new: "pending"}
    finally:
        await conn.close()


async def every_row(conn: asyncpg.Connection, table: str) -> list[dict]:
    return [dict(r) for r in await conn.fetch(f"SELECT * FROM {table} ORDER BY 1, 2")]


async def test_0017_keeps_every_row_and_refuses_each_broken_one_column_rule_through_its_domain(scratch):
    await migrate(scratch, revision_before("0017"))
    conn = await asyncpg.connect(scratch)
    try:
        client = await conn.fetchval("INSERT INTO client (name, api_key_hash) VALUES ('c', 'h') RETURNING id")
        for status in STATUSES:
            await insert_payment(conn, uuid.uuid4(), client, f"order-{status}", "processing")
            await conn.execute("UPDATE payment SET status = $1, holds_reference = $2 WHERE reference = $3",
                               status, status not in ("declined", "failed"), f"order-{status}")
        paid = await conn.fetchval("SELECT id FROM payment WHERE status = 'succeeded'")
        await conn.execute("INSERT INTO ledger_entry (payment_id, posting, account, debit_minor, credit_minor, currency) "
                           "VALUES ($1, 'charge_captured', 'psp', 1250, 0, 'EUR'), "
                           "($1, 'charge_captured', 'client', 0, 1250, 'EUR')", paid)
        await conn.execute("INSERT INTO idempotency_key (client_id, key, endpoint, request_hash, state, recovery_point, "
                           "payment_id, response_code, response_body) VALUES ($1, 'k-done', 'POST /v1/payments', "
                           "'\\x00', 'finished', 'FINISHED', $2, 201, '{}'), ($1, 'k-open', 'POST /v1/payments', "
                           "'\\x00', 'started', 'EXT1_SENT', NULL, NULL, NULL)", client, paid)
        await conn.execute("INSERT INTO event (client_id, payment_id, type, data) "
                           "VALUES ($1, $2, 'payment.succeeded', '{}')", client, paid)
        tables = ("payment", "ledger_entry", "idempotency_key", "event")
        before = {t: await every_row(conn, t) for t in tables}
        # The tables and the key table's partitions, and every index of theirs that names no changed column
        # (the key table's two indexes of unfinished keys name `state` in their WHERE: those are built again).
        stored = ("SELECT c.relname, pg_relation_filenode(c.oid) FROM pg_class c "
                  "WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'i') "
                  "AND (c.relname ~ '^(payment|ledger_entry|event|idempotency_key)' "
                  "AND c.oid NOT IN (SELECT indexrelid FROM pg_index WHERE pg_get_expr(indpred, indrelid) ~ 'state'))")
        files = dict(await conn.fetch(stored))
        assert {"payment", "payment_pkey", "ledger_entry", "event", "idempotency_key_legacy"} <= set(files)
        names = "SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid::regclass::text ~ '^idempotency_key' ORDER BY 1"
        indexes = [r[0] for r in await conn.fetch(names)]
    finally:
        await conn.close()

    await migrate(scratch, "0017")

    conn = await asyncpg.connect(scratch)
    try:
        for t in tables:
            assert await every_row(conn, t) == before[t], t
        # Nothing was rewritten or built again: each table and index keeps its file.
        assert dict(await conn.fetch(stored)) == files
        # The key table's indexes that were built again keep their names (the legacy partition's its own).
        assert [r[0] for r in await conn.fetch(names)] == indexes
        assert "idempotency_key_legacy_unfinished" in indexes
        # Each column's type is its domain, and no table keeps a CHECK on one column of a new payment's
        # (else the server would still read it back on every write: what this revision is for).
        typed = dict(await conn.fetch(
            "SELECT c.table_name || '.' || c.column_name, c.domain_name FROM information_schema.columns c "
            "WHERE c.table_schema = 'public' AND c.domain_name IS NOT NULL AND c.table_name = ANY($1)", list(tables)))
        assert typed == {
            "payment.amount_minor": "positive_minor", "payment.net_minor": "positive_minor",
            "payment.fee_minor": "nonnegative_minor", "payment.status": "payment_status",
            "ledger_entry.debit_minor": "nonnegative_minor", "ledger_entry.credit_minor": "nonnegative_minor",
            "idempotency_key.state": "key_state", "idempotency_key.response_body": "stored_response",
            "event.type": "event_type",
        }
        checks = await conn.fetch(
            "SELECT conrelid::regclass::text AS t, conname, convalidated, array_length(conkey, 1) AS columns "
            "FROM pg_constraint WHERE contype = 'c' AND conrelid = ANY($1::regclass[])", list(tables))
        assert {(r["t"], r["conname"]) for r in checks} == {
            ("payment", "payment_check"), ("payment", "payment_refunded_within_amount"),
            ("payment", "payment_holds_reference_by_status"), ("ledger_entry", "ledger_entry_check"),
            ("idempotency_key", "idempotency_key_check"),
        }
        assert all(r["convalidated"] and r["columns"] > 1 for r in checks)

        # Bug caught: a rule lost on the way. Each one-column rule is refused through its domain, and each
        # rule between columns through its table, as before.
        refused = [
            ("UPDATE payment SET status = 'lost' WHERE reference = 'order-processing'", "payment_status_check"),
            ("UPDATE payment SET amount_minor = 0, net_minor = 0, fee_minor = 0 WHERE reference = 'order-failed'",
             "positive_minor_check"),
            ("UPDATE payment SET fee_minor = -1, net_minor = 1251 WHERE reference = 'order-failed'",
             "nonnegative_minor_check"),
            ("UPDATE payment SET fee_minor = 44 WHERE reference = 'order-failed'", "payment_check"),
            ("UPDATE payment SET refunded_minor = 1251 WHERE reference = 'order-refunded'",
             "payment_refunded_within_amount"),
            ("UPDATE payment SET status = 'declined' WHERE reference = 'order-processing'",
             "payment_holds_reference_by_status"),
            ("UPDATE ledger_entry SET credit_minor = -1 WHERE account = 'client'", "nonnegative_minor_check"),
            ("UPDATE ledger_entry SET credit_minor = 1 WHERE account = 'psp'", "ledger_entry_check"),
            ("UPDATE idempotency_key SET state = 'paused' WHERE key = 'k-open'", "key_state_check"),
            ("UPDATE idempotency_key SET response_body = repeat('x', 4097) WHERE key = 'k-done'",
             "stored_response_check"),
            ("UPDATE idempotency_key SET state = 'finished' WHERE key = 'k-open'", "idempotency_key_check"),
            ("UPDATE event SET type = 'Payment.Succeeded'", "event_type_check"),
        ]
        for statement, rule in refused:
            with pytest.raises(asyncpg.CheckViolationError) as refusal:
                await conn.execute(statement)
            assert refusal.value.constraint_name == rule, statement
        for t in tables:
            assert await every_row(conn, t) == before[t], t
    finally:
        await conn.close()

    # Back to the previous revision: the same rows, each rule a CHECK of its table again.
    await downgrade(scratch, revision_before("0017"))
    conn = await asyncpg.connect(scratch)
    try:
        for t in tables:
            assert await every_row(conn, t) == before[t], t
        assert not await conn.fetchval("SELECT count(*) FROM pg_type WHERE typtype = 'd' AND typnamespace = "
                                       "'public'::regnamespace")
        with pytest.raises(asyncpg.CheckViolationError) as refusal:
            await conn.execute("UPDATE payment SET status = 'lost' WHERE reference = 'order-processing'")
        assert refusal.value.constraint_name == "payment_status_check"
    finally:
        await conn.close()


async def test_0018_keeps_every_delivery_and_attempt_and_records_an_attempt_through_its_row_type(scratch):
    await migrate(scratch, revision_before("0018"))
    conn = await asyncpg.connect(scratch)
    try:
        client, _, event_id = await insert_event_of_a_client_with_an_endpoint(conn)
        # As a claim of the previous revision leaves a retry: its delivery leased, its attempt row open.
        lease = uuid.uuid4()
        await conn.execute("INSERT INTO webhook_delivery (event_id, client_id, attempts, lease_token, lease_expires_at) "
                           "VALUES ($1, $2, 1, $3, now() + interval '30 seconds')", event_id, client, lease)
        await conn.execute("INSERT INTO webhook_attempt (event_id, attempt, url) "
                           "VALUES ($1, 1, 'https://example.com/hook')", event_id)
        tables = ("event", "webhook_delivery", "webhook_attempt")
        before = {t: await every_row(conn, t) for t in tables}
        created = await conn.fetchval("SELECT created_at FROM event WHERE id = $1", event_id)
    finally:
        await conn.close()

    await migrate(scratch, "0018")

    conn = await asyncpg.connect(scratch)
    try:
        for t in tables:
            assert await every_row(conn, t) == before[t], t
        fields = [r[0] for r in await conn.fetch(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'webhook_answer'::regclass AND attnum > 0 "
            "ORDER BY attnum")]
        assert fields == ["event_id", "lease_token", "client_id", "url", "state", "outcome", "retry_in",
                          "status_code", "latency_ms", "error_class", "error"]
    finally:
        await conn.close()

    # Bug caught: a type whose fields are not those the dispatcher sends, in its order. The retry is
    # recorded through it, by the dispatcher's own statement, as delivered.
    claimed = delivery.Claimed(event_id=event_id, client_id=client, attempt=1, due_attempt=1, lease_token=lease,
                               url="https://example.com/hook", secret="s", type="payment.succeeded", data="{}",
                               created_at=created)
    engine = create_async_engine(asyncpg_url(scratch))
    try:
        recorded = await one_statement(engine, delivery.record, [delivery.Attempted(
            claimed, delivery.Answer(200, 12.5, None), delivery.Decision(delivery.DELIVERED))])
    finally:
        await engine.dispose()
    assert recorded == {event_id}
    conn = await asyncpg.connect(scratch)
    try:
        row = await conn.fetchrow("SELECT d.state, d.lease_token, d.last_status, a.outcome, a.status_code, "
                                  "a.latency_ms FROM webhook_delivery d JOIN webhook_attempt a USING (event_id)")
        assert tuple(row) == ("delivered", None, 200, "delivered", 200, 12.5)
        after = {t: await every_row(conn, t) for t in tables}
    finally:
        await conn.close()

    # Back to the previous revision: the type is gone, every row stays as recorded.
    await downgrade(scratch, revision_before("0018"))
    conn = await asyncpg.connect(scratch)
    try:
        assert await conn.fetchval("SELECT to_regtype('webhook_answer')") is None
        for t in tables:
            assert await every_row(conn, t) == after[t], t
    finally:
        await conn.close()


async def test_0019_keeps_every_endpoint_at_one_event_a_post_and_lets_the_dispatcher_read_its_size(scratch):
    await migrate(scratch, revision_before("0019"))
    conn = await asyncpg.connect(scratch)
    try:
        _, _, event_id = await insert_event_of_a_client_with_an_endpoint(conn)
        before = await every_row(conn, "webhook_endpoint")
    finally:
        await conn.close()

    await migrate(scratch, "0019")

    conn = await asyncpg.connect(scratch)
    try:
        after = await every_row(conn, "webhook_endpoint")
        assert [{k: v for k, v in r.items() if k != "events_per_post"} for r in after] == before
        assert [r["events_per_post"] for r in after] == [1], "an existing endpoint keeps one event a POST"
        for wrong in (0, 101):
            with pytest.raises(asyncpg.CheckViolationError):
                await conn.execute("UPDATE webhook_endpoint SET events_per_post = $1", wrong)
        key = SecretsKey(SECRETS_KEY)
        await conn.execute("UPDATE webhook_endpoint SET events_per_post = 7, secret_sealed = $1",
                           key.seal(new_secret()))
        # The cursor reads only behind every transaction still running on the
        # server (another test's, in another database, too): wait for that.
        await behind_every_running_transaction(conn)
    finally:
        await conn.close()

    # Bug caught: a read that does not carry the endpoint's size, so that every event goes alone.
    engine = create_async_engine(asyncpg_url(scratch))
    try:
        batch = await one_statement(engine, delivery.take, limit=16, lease_seconds=30, key=key)
    finally:
        await engine.dispose()
    # The event was written at the previous revision, behind the cursor: its first attempt is read now.
    assert [(c.event_id, c.events_per_post) for c in batch.to_send] == [(event_id, 7)]

    await downgrade(scratch, revision_before("0019"))
    conn = await asyncpg.connect(scratch)
    try:
        assert [{k: v for k, v in r.items() if k not in ("secret_sealed",)}
                for r in await every_row(conn, "webhook_endpoint")] == [
            {k: v for k, v in r.items() if k not in ("secret_sealed",)} for r in before]
    finally:
        await conn.close()
