"""The key table across midnight, and its retention: one key row per key, whatever the day.

The key table is partitioned by day (migration 0006), and PostgreSQL cannot
make `(client_id, key)` unique across partitions. A claim stays unique
because claim_idempotency_key locks the key, then looks in every partition
with a fresh snapshot. These tests move the key table's clock
(`key_table_clock()`, replaced in this run's database) to just before and
just after midnight, with claims in flight across the switch, and read the
evidence: key rows, payments, the PSP's charges, and every answer a client
got. Each fails with the lock removed, and with the look removed
(tests/mutants.py: claim-lock, claim-look).

Retention: a reap drops only partitions wholly past KEY_RETENTION_HOURS, and
only after moving every live row out; the live keys still work afterwards,
and a retry of a reaped key is a new request that the payment's reference
refuses (409 duplicate-payment).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, date, datetime, timedelta

import asyncpg
import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from app import client_accounts

from app.config import asyncpg_url
from app.db.transaction import atomic, autocommit, one_statement
from app.idempotency import key_table, partitions
from app.idempotency.key_table import CALLER_SQL
from app.machine import engine as machine_engine
from app.machine.declare import Operation
from app.payments import phases
from app.payments.batches import consumption
from app.payments.payment import PAYMENT
from app.payments.models import PaymentRequest
from app.payments.submission import fingerprint
from app.rails.answers import Charge
from tests.support import charges, headers, key_row, payment_body, payments_for, until

RETENTION = timedelta(hours=72)  # the default KEY_RETENTION_HOURS


@pytest.fixture
async def engine(database_url):
    engine = create_async_engine(asyncpg_url(database_url))
    yield engine
    await engine.dispose()


class KeyClock:
    """The key table's clock in this run's database, set to a fixed instant (leases keep real time)."""

    def __init__(self, db) -> None:
        self.db = db

    async def set(self, at: datetime) -> None:
        await self.db.execute(
            "CREATE OR REPLACE FUNCTION key_table_clock() RETURNS timestamptz LANGUAGE sql STABLE "
            f"AS $$ SELECT timestamptz '{at.isoformat()}' $$"
        )

    async def real(self) -> None:
        await self.db.execute(
            "CREATE OR REPLACE FUNCTION key_table_clock() RETURNS timestamptz LANGUAGE sql STABLE AS $$ SELECT now() $$"
        )


@pytest.fixture
async def key_clock(db, engine):
    clock = KeyClock(db)
    yield clock
    await clock.real()
    # A reap under a moved clock may have dropped today's partition: the
    # tests after this one need it back, as `payments migrate` would.
    await autocommit(engine, partitions.ensure_ahead)


def today() -> date:
    return datetime.now(UTC).date()


def midnight(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


async def key_rows(db, client_id: int, key: str):
    return await db.fetch(
        "SELECT tableoid::regclass::text AS partition, * FROM idempotency_key WHERE client_id = $1 AND key = $2",
        client_id, key,
    )


async def claim(engine, client, key: str, body: dict, lease_seconds: float = 30) -> Operation | None:
    """The claim a POST makes (handler1), as one statement."""
    request = PaymentRequest.model_validate(body)
    return await one_statement(
        engine, phases.handler1, PAYMENT, client_id=client.id, key=key, request_hash=fingerprint(request),
        request=request, lease_seconds=lease_seconds,
    )


async def test_a_retry_just_after_midnight_finds_yesterdays_key_and_claims_no_second_one(
    stack, http, db, engine, acme, key_clock
):
    eve = today() + timedelta(days=1)  # a day whose partition, and the next day's, exist
    body = payment_body()
    await key_clock.set(midnight(eve + timedelta(days=1)) - timedelta(milliseconds=1))
    first = await http.post(stack.api + "/v1/payments", json=body, headers=headers(acme, "k-eve"))
    assert first.status_code == 201, first.text
    started = payment_body()
    assert await claim(engine, acme, "k-eve-started", started) is not None  # in flight: a live lease

    await key_clock.set(midnight(eve + timedelta(days=1)) + timedelta(milliseconds=1))
    for api in stack.apis:  # the replay shortcut, and the route
        retry = await http.post(api.url + "/v1/payments", json=body, headers=headers(acme, "k-eve"))
        assert retry.status_code == 201 and retry.headers.get("Idempotent-Replayed") == "true"
        assert retry.content == first.content
        busy = await http.post(api.url + "/v1/payments", json=started, headers=headers(acme, "k-eve-started"))
        assert busy.status_code == 409 and busy.json()["type"] == "/problems/request-in-progress", busy.text
    # The claim itself, as a retry whose read raced the first attempt makes
    # it: it must find yesterday's row, not insert one for today.
    assert await claim(engine, acme, "k-eve", body) is None
    assert await claim(engine, acme, "k-eve-started", started) is None

    for key, reference in (("k-eve", body["reference"]), ("k-eve-started", started["reference"])):
        rows = await key_rows(db, acme.id, key)
        assert [r["partition"] for r in rows] == [partitions.partition_name(eve)]
        assert len(await payments_for(db, reference)) == 1
    assert len(await charges(db, body["reference"])) == 1


async def test_concurrent_posts_of_one_key_straddling_midnight_make_one_key_one_payment_one_charge(
    stack, http, db, database_url, acme, key_clock
):
    eve = today() + timedelta(days=1)
    body = payment_body()
    await key_clock.set(midnight(eve + timedelta(days=1)) - timedelta(milliseconds=1))
    # Hold the first claim at its payment's insert (made after the claim has
    # locked, looked and inserted its key row): an uncommitted payment of the
    # same client and reference makes that insert wait to learn whether it
    # conflicts; the other claims wait on the first's advisory lock. So claims
    # made before midnight are still uncommitted when the clock passes it and
    # more claims of the same key arrive. The blocker then rolls back: its
    # payment never existed.
    blocker = await asyncpg.connect(database_url)
    try:
        held = blocker.transaction()
        await held.start()
        try:
            await blocker.execute(
                "INSERT INTO payment (id, client_id, reference, amount_minor, currency, fee_minor, net_minor, "
                "card_token, beneficiary_name, beneficiary_iban, status) "
                "VALUES (gen_random_uuid(), $1, $2, 1, 'EUR', 0, 1, 'tok', 'blocker', 'x', 'processing')",
                acme.id, body["reference"],
            )

            async def post(i: int) -> httpx.Response:
                return await http.post(stack.apis[i % 2].url + "/v1/payments", json=body, headers=headers(acme, "k-border"))

            before = [asyncio.create_task(post(i)) for i in range(6)]
            await until(lambda: waiting_on_locks(db, 6), "six claims before midnight to be waiting")
            await key_clock.set(midnight(eve + timedelta(days=1)) + timedelta(milliseconds=1))
            after = [asyncio.create_task(post(i)) for i in range(6)]
            await until(lambda: waiting_on_locks(db, 12), "six more claims after midnight to be waiting")
        finally:
            await held.rollback()
    finally:
        await blocker.close()
    answers = await asyncio.gather(*before, *after)

    kinds = [(a.status_code, a.json().get("type", "a payment")) for a in answers]
    assert set(kinds) <= {(201, "a payment"), (202, "a payment"), (409, "/problems/request-in-progress")}, kinds
    assert [r["partition"] for r in await key_rows(db, acme.id, "k-border")] == [partitions.partition_name(eve)]
    assert len(await payments_for(db, body["reference"])) == 1

    async def finished() -> bool:
        return (await key_row(db, acme.id, "k-border"))["state"] == "finished"

    await until(finished, "the payment to finish")
    assert len(await charges(db, body["reference"])) == 1


async def second_claim_while_the_first_is_open(db, engine, acme, key_clock, key: str, first: dict, second: dict,
                                              first_at: datetime, second_at: datetime) -> Operation | None:
    """Claim `key` for `first` at `first_at` and hold its transaction open; claim it for `second` at
    `second_at`, which waits for the first's lock; commit the first, and return what the second claim got."""
    await key_clock.set(first_at)
    async with engine.connect() as conn:
        async with conn.begin():
            request = PaymentRequest.model_validate(first)
            op = await phases.handler1(
                conn, PAYMENT, client_id=acme.id, key=key, request_hash=fingerprint(request), request=request,
                lease_seconds=30,
            )
            assert op is not None
            await key_clock.set(second_at)
            waiting = asyncio.create_task(claim(engine, acme, key, second))

            async def waiting_or_done() -> bool:
                return waiting.done() or await waiting_on_locks(db, 1)

            await until(waiting_or_done, "the second claim to wait for the first")
        # The first claim commits here.
    return await waiting


async def test_a_claim_held_open_across_midnight_makes_a_second_claim_of_its_key_wait_and_find_it(
    stack, http, db, engine, acme, key_clock
):
    eve = today() + timedelta(days=1)
    first, second = payment_body(), payment_body()  # a client bug: one key, two different orders
    midnight_after_eve = midnight(eve + timedelta(days=1))
    late = await second_claim_while_the_first_is_open(
        db, engine, acme, key_clock, "k-held", first, second,
        first_at=midnight_after_eve - timedelta(milliseconds=1), second_at=midnight_after_eve + timedelta(milliseconds=1),
    )
    assert late is None, "the second claim must find the first one's key, not claim its own"

    assert [r["partition"] for r in await key_rows(db, acme.id, "k-held")] == [partitions.partition_name(eve)]
    assert len(await payments_for(db, first["reference"])) == 1
    assert await payments_for(db, second["reference"]) == []
    reused = await http.post(stack.api + "/v1/payments", json=second, headers=headers(acme, "k-held"))
    assert reused.status_code == 422 and reused.json()["type"] == "/problems/idempotency-key-reused"


async def test_a_claim_whose_day_is_still_before_midnight_finds_a_key_claimed_just_after_it(
    db, engine, acme, key_clock
):
    # The reverse of the test above: the claim that waits began before
    # midnight, the one it waits for just after, and stored its key on the
    # later day. Bug caught: a claim's look bounded at its own day (not the
    # day after, key_table_last_day() in migration 0015), which would miss
    # the key and insert a second row for it on the earlier day.
    eve = today() + timedelta(days=1)
    first, second = payment_body(), payment_body()
    midnight_after_eve = midnight(eve + timedelta(days=1))
    early = await second_claim_while_the_first_is_open(
        db, engine, acme, key_clock, "k-after", first, second,
        first_at=midnight_after_eve + timedelta(milliseconds=1), second_at=midnight_after_eve - timedelta(milliseconds=1),
    )
    assert early is None, "the claim must find the key stored on the day after its own"

    assert [r["partition"] for r in await key_rows(db, acme.id, "k-after")] == [
        partitions.partition_name(eve + timedelta(days=1))
    ]
    assert await payments_for(db, second["reference"]) == []


async def test_a_new_payments_looks_for_its_key_probe_no_partition_after_tomorrows(engine, acme):
    # Bug caught: the caller's lookup or the claim's look probing the empty
    # partitions of the days ahead (migration 0015 prunes them): the counts
    # are this transaction's own, whatever else the database is doing.
    key = "k-probes"
    request = PaymentRequest.model_validate(payment_body())

    async def look_claim_and_count(conn):
        await conn.exec_driver_sql(CALLER_SQL, (client_accounts.hash_api_key(acme.api_key), key))
        assert await phases.handler1(conn, PAYMENT, client_id=acme.id, key=key, request_hash=fingerprint(request),
                                     request=request, lease_seconds=30) is not None
        return await probes_by_partition(conn)

    probes = await atomic(engine, look_claim_and_count)
    later = days_after_tomorrow(probes)
    assert later and set(later.values()) == {0}, probes  # six days ahead, never probed
    # Today's and tomorrow's are probed by both looks (the legacy partition
    # reaches to the day after migration 0006 ran, so it may stand for them).
    assert sum(n for name, n in probes.items() if name not in later) >= 2, probes


async def test_a_keys_load_and_a_batch_rows_read_and_link_probe_no_partition_after_tomorrows(engine, acme):
    # Bug caught: key_table.load (the key endpoint's read, the row read after
    # a takeover), a batch row's read of its key or its link to its payment
    # probing the empty partitions of the days ahead, as the new payment's
    # looks once did (the test above). One transaction: the counts are its own.
    key = uuid.uuid4()  # a batch row's key
    request = PaymentRequest.model_validate(payment_body())
    batch = uuid.uuid4()

    async def claim_load_link_and_count(conn):
        claimed = await phases.handler1(conn, PAYMENT, client_id=acme.id, key=str(key),
                                        request_hash=fingerprint(request), request=request, lease_seconds=30)
        await conn.execute(text(
            "INSERT INTO payment_batch (id, client_id, reference, idempotency_key, row_count)"
            " VALUES (:batch, :client, 'probes', 'probes', 1)"
        ), dict(batch=batch, client=acme.id))
        await conn.execute(text(
            "INSERT INTO payment_batch_row (batch_id, row_number, client_id, row_key, reference, value_date, request)"
            " VALUES (:batch, 1, :client, :key, 'probes-1', current_date, '{}')"
        ), dict(batch=batch, client=acme.id, key=key))
        before = await probes_by_partition(conn)  # the claim's own look: the test above
        stored = await key_table.load(conn, acme.id, str(key))
        row = await consumption._fetch(conn, batch, 1)
        await consumption._link(conn, batch, 1)
        linked = await conn.scalar(text("SELECT payment_id FROM payment_batch_row WHERE batch_id = :batch"),
                                   dict(batch=batch))
        assert stored.payment_id == row.stored.payment_id == claimed.subject.id == linked, "all found the key row"
        after = await probes_by_partition(conn)
        return {name: after[name] - before[name] for name in after}

    probes = await atomic(engine, claim_load_link_and_count)
    later = days_after_tomorrow(probes)
    assert later and set(later.values()) == {0}, probes
    assert sum(probes.values()) >= 3, probes  # the load's probe, the row's read's and the link's


async def probes_by_partition(conn) -> dict[str, int]:
    """Index scans of each key table partition's primary key so far in this transaction."""
    rows = await conn.execute(text(
        "SELECT c.relname AS partition, pg_stat_get_xact_numscans(i.indexrelid) AS probes "
        "FROM pg_inherits h JOIN pg_class c ON c.oid = h.inhrelid "
        "JOIN pg_index i ON i.indrelid = c.oid AND i.indisprimary "
        "WHERE h.inhparent = CAST('idempotency_key' AS regclass)"
    ))
    return {r.partition: r.probes for r in rows}


def days_after_tomorrow(probes: dict[str, int]) -> dict[str, int]:
    tomorrow = today() + timedelta(days=1)
    return {name: n for name, n in probes.items()
            if name > partitions.partition_name(tomorrow) and name != "idempotency_key_legacy"}


async def test_a_claim_on_a_day_without_a_partition_is_answered_503_and_stores_nothing(
    stack, http, db, acme, key_clock
):
    await key_clock.set(midnight(today() + timedelta(days=60)))
    body = payment_body()
    for api in stack.apis:
        answer = await http.post(api.url + "/v1/payments", json=body, headers=headers(acme, "k-nowhere"))
        assert answer.status_code == 503, answer.text
        assert answer.headers["content-type"] == "application/problem+json"
        assert answer.json()["type"] == "/problems/key-table-unavailable"
        assert int(answer.headers["Retry-After"]) > 0
    assert await key_rows(db, acme.id, "k-nowhere") == []
    assert await payments_for(db, body["reference"]) == []


async def test_a_reap_drops_only_finished_keys_past_retention_and_every_live_key_still_works(
    stack, http, db, engine, acme, key_clock, processes
):
    done_body = payment_body()
    done = await http.post(stack.api + "/v1/payments", json=done_body, headers=headers(acme, "k-done"))
    assert done.status_code == 201
    parked = await claim(engine, acme, "k-parked", payment_body())
    await atomic(engine, machine_engine.park, parked, "rail: timed out", 3600)
    released = await claim(engine, acme, "k-released", payment_body())
    await atomic(engine, machine_engine.release, released, "psp: timed out", 0)
    held = await claim(engine, acme, "k-held", payment_body(), lease_seconds=600)  # its owner is at work
    [old] = {r["partition"] for r in await db.fetch("SELECT tableoid::regclass::text AS partition FROM idempotency_key")}

    later = today() + timedelta(days=4)  # the day after today is 72 h past
    await key_clock.set(midnight(later) + timedelta(hours=1))
    code, output = await processes.cli("keys", "reap", "--dry-run")
    assert code == 0, output
    assert f"would move 3 live rows out of {old}" in output and "1 of them held by a live owner" in output, output
    assert {r["partition"] for r in await db.fetch("SELECT tableoid::regclass::text AS partition FROM idempotency_key")} == {old}

    code, output = await processes.cli("keys", "reap")
    assert code == 0, output
    assert f"move 2 live rows out of {old}" in output and f"{old} is kept for another day" in output, output
    moved_to = partitions.partition_name(later)
    assert {k: (await key_rows(db, acme.id, k))[0]["partition"] for k in ("k-done", "k-parked", "k-released", "k-held")} == {
        "k-done": old, "k-parked": moved_to, "k-released": moved_to, "k-held": old,
    }

    # The owner of the held key finishes it where it is.
    await atomic(engine, phases.record_charge, held, Charge(id="ch_x", status="declined", decline_code="card_declined"), 30)
    # The worker's daily tick for the key table's day: it drops the old
    # partition now, and recovers the released payment from its new one.
    processes.worker()

    async def reaped() -> bool:
        run = await db.fetchrow(
            "SELECT state, counts FROM scheduled_run WHERE job = 'key-partitions' AND window_start = $1", later
        )
        return run is not None and run["state"] == "finished"

    await until(reaped, "the worker's key partition tick")
    counts = json.loads(await db.fetchval("SELECT counts FROM scheduled_run WHERE job = 'key-partitions'"))
    assert counts["partitions_dropped"] == 1 and counts["rows_dropped"] == 2, counts  # k-done and k-held
    assert await db.fetchval("SELECT to_regclass($1)", old) is None
    assert await key_rows(db, acme.id, "k-done") == [] and await key_rows(db, acme.id, "k-held") == []

    async def recovered() -> bool:
        return (await key_row(db, acme.id, "k-released"))["state"] == "finished"

    await until(recovered, "the worker to finish the released payment from its new partition")
    unparked = await atomic(engine, machine_engine.unpark, PAYMENT, acme.id, "k-parked", 30, event="settled by a person")
    assert unparked is not None and unparked.recovery_point == "EXT1_SENT"

    # Business records are never reaped: the payment of the reaped key is
    # there, with its ledger; and a retry of the reaped key is a new request
    # that the reference refuses.
    [payment] = await payments_for(db, done_body["reference"])
    assert payment["status"] == "succeeded"
    assert await db.fetchval("SELECT count(*) FROM ledger_entry WHERE payment_id = $1", payment["id"]) > 0
    retry = await http.post(stack.api + "/v1/payments", json=done_body, headers=headers(acme, "k-done"))
    assert retry.status_code == 409, retry.text
    assert retry.json()["type"] == "/problems/duplicate-payment" and retry.json()["payment_id"] == str(payment["id"])
    assert await key_rows(db, acme.id, "k-done") == []
    assert len(await payments_for(db, done_body["reference"])) == 1
    assert len(await charges(db, done_body["reference"])) == 1


@pytest.mark.parametrize(
    "query",
    [
        "SELECT * FROM idempotency_key WHERE client_id = 1 AND key = 'k'",
        "UPDATE idempotency_key SET attempts = attempts WHERE client_id = 1 AND key = 'k' AND lease_token = gen_random_uuid()",
    ],
)
async def test_a_look_up_by_client_and_key_probes_each_partitions_index_and_reads_no_table_whole(db, query):
    plan = json.loads(await db.fetchval(f"EXPLAIN (FORMAT JSON) {query}"))
    scans = _scans(plan[0]["Plan"])
    assert scans and all(kind in ("Index Scan", "Index Only Scan", "Bitmap Heap Scan") for kind, _ in scans), scans


def _scans(node: dict) -> list[tuple[str, str]]:
    found = [(node["Node Type"], node.get("Relation Name", ""))] if "Scan" in node["Node Type"] else []
    for child in node.get("Plans", []):
        found += _scans(child)
    return [f for f in found if f[0] != "Bitmap Index Scan"]


async def waiting_on_locks(db, n: int) -> bool:
    count = await db.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    return count >= n
