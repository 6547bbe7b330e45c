"""Payment batches end to end: upload, outbox, broker, consumer, completion; judged on the PSP's and rail's records and the ledger.

Each test runs a NATS server of its own (from the wheel, on free ports, its
store in the test's directory) and `payments consume` processes against the
session's API, fakes and database. `make test-batches`, not `make test`:
each takes several seconds of real payments.
"""

from __future__ import annotations

import json
import uuid

import nats

from app.broker import jetstream
from app.payments.batches.rows import natural_key, payment_reference
from tests.batches.support import (  # noqa: F401  (broker: a fixture)
    _date, broker, charges_per_row, completed, consumer, csv_file, each_once, upload,
)
from tests.support import headers, payment_body, unbalanced_payments, until


async def test_a_batch_is_paid_once_per_row_and_completed_once(http, stack, db, shop, broker, processes):
    acme = shop  # a client with a webhook endpoint at the fake merchant
    accepted = await upload(http, stack.api, acme, csv_file(20))
    assert accepted.status_code == 202, accepted.text
    batch = accepted.json()
    assert accepted.headers["Location"] == f"/v1/payment-batches/{batch['id']}"
    assert await db.fetchval("SELECT count(*) FROM batch_outbox WHERE batch_id = $1", uuid.UUID(batch["id"])) == 20
    consumer(processes)
    done = await completed(http, stack.api, acme, batch["id"])
    assert done["counts"] == {"succeeded": 20} and done["failed_rows"] == []
    assert each_once(await charges_per_row(db, acme.id, "payroll-2026-12", range(1, 21)))
    assert await unbalanced_payments(db) == []
    assert await db.fetchval("SELECT count(*) FROM batch_outbox") == 0
    # The event, once, and no row of the batch updated the batch's own row but the completion.
    events = await db.fetch("SELECT data FROM event WHERE type = 'batch.completed'")
    assert len(events) == 1 and json.loads(events[0]["data"])["id"] == batch["id"]
    # ...and its webhook, applied once by the merchant's inbox, beside the rows' own.
    processes.worker()

    async def delivered() -> bool:
        return await db.fetchval("SELECT count(*) FROM fake_merchant.processed_message") == 21

    await until(delivered, "the 20 payments' webhooks and the batch's delivered")
    types = dict(await db.fetch("SELECT type, count(*) FROM fake_merchant.processed_message GROUP BY 1"))
    assert types == {"payment.succeeded": 20, "batch.completed": 1}
    # Each row's key is its natural key, and its payment's reference derives from it.
    key = natural_key(acme.id, "payroll-2026-12", "emp-00007", _date())
    row = await db.fetchrow("SELECT k.state, p.reference FROM idempotency_key k JOIN payment p ON p.id = k.payment_id"
                            " WHERE k.client_id = $1 AND k.key = $2", acme.id, str(key))
    assert row["state"] == "finished" and row["reference"] == payment_reference(key)


ROW_PAYMENT = """
    SELECT r.row_number, coalesce(r.payment_id, k.payment_id) AS payment_id, r.duplicate
      FROM payment_batch_row r
      LEFT JOIN idempotency_key k ON k.client_id = r.client_id AND k.key = CAST(r.row_key AS text)
     WHERE r.batch_id = $1
"""


async def test_the_same_file_again_pays_nothing_twice_within_and_after_key_retention(
    http, stack, db, acme, broker, processes, tmp_path
):
    body = csv_file(20)
    first = (await upload(http, stack.api, acme, body)).json()
    first_consumer = consumer(processes)
    await completed(http, stack.api, acme, first["id"])
    paid = {r["row_number"]: r["payment_id"] for r in await db.fetch(ROW_PAYMENT, uuid.UUID(first["id"]))}
    assert len(set(paid.values())) == 20 and None not in paid.values()
    # Within retention: a new upload, a new key; every row is the same payment.
    # (Within the broker's duplicate window its publishes are dropped, being
    # the same message ids; after it, they are delivered and replayed. The
    # broker is not what decides either way: the key table is.)
    second = (await upload(http, stack.api, acme, body)).json()
    assert second["id"] != first["id"]
    done = await completed(http, stack.api, acme, second["id"])
    assert done["counts"] == {"succeeded": 20}
    assert {r["row_number"]: r["payment_id"] for r in await db.fetch(ROW_PAYMENT, uuid.UUID(second["id"]))} == paid
    # After retention: the rows' key rows are reaped, and the broker has long
    # forgotten the message ids (a broker with a fresh store: past its
    # window). Every row is delivered, and refused as a duplicate of the
    # payment its derived reference names; nothing is paid.
    await db.execute("DELETE FROM idempotency_key WHERE endpoint = 'POST /v1/payments'")
    first_consumer.kill()
    processes.system.start_nats(tmp_path / "nats-days-later")
    consumer(processes, "consumer-days-later")
    third = (await upload(http, stack.api, acme, body)).json()
    await completed(http, stack.api, acme, third["id"])
    late = await db.fetch(ROW_PAYMENT, uuid.UUID(third["id"]))
    assert {r["row_number"]: r["payment_id"] for r in late} == paid and all(r["duplicate"] for r in late)
    assert each_once(await charges_per_row(db, acme.id, "payroll-2026-12", range(1, 21)))
    assert await db.fetchval("SELECT count(*) FROM event WHERE type = 'batch.completed'") == 3


async def test_a_poison_row_is_dead_lettered_after_its_last_delivery_and_the_rest_are_paid(
    http, stack, db, acme, broker, processes
):
    # The row's natural key was already used for a different payment (an
    # edited file sent again, say): refused the same way on every delivery.
    key = natural_key(acme.id, "payroll-2026-12", "emp-00003", _date())
    taken = await http.post(stack.api + "/v1/payments", json=payment_body(), headers=headers(acme, str(key)))
    assert taken.status_code == 201
    batch = (await upload(http, stack.api, acme, csv_file(20))).json()
    consumer(processes, BATCH_MAX_DELIVERIES="3")
    done = await completed(http, stack.api, acme, batch["id"])
    assert done["counts"] == {"succeeded": 19, "dead_lettered": 1}
    [dead] = done["failed_rows"]
    assert dead["row"] == 3 and dead["state"] == "dead_lettered" and "idempotency-key-reused" in dead["reason"]
    # On the dead-letter stream too, for a person, after exactly the bounded deliveries.
    nc = await nats.connect(broker.url)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe(jetstream.DEAD_SUBJECT, durable="inspect", stream=jetstream.DEAD_STREAM)
        [msg] = await sub.fetch(1, timeout=5)
        assert msg.headers[jetstream.MSG_ID] == str(key) and msg.headers["Payments-Deliveries"] == "3"
    finally:
        await nc.close()
    assert await db.fetchval("SELECT count(*) FROM fake_psp.charge") == 20  # 19 rows and the earlier payment


async def test_a_row_published_twice_beyond_the_dedup_window_is_answered_by_replay(
    http, stack, db, acme, broker, processes
):
    batch = (await upload(http, stack.api, acme, csv_file(20))).json()
    consumer(processes)
    await completed(http, stack.api, acme, batch["id"])
    # A copy the broker cannot deduplicate: the same row under another
    # message id, as a re-publish after the duplicate window would be.
    nc = await nats.connect(broker.url)
    try:
        js = nc.jetstream()
        for n in range(1, 21):
            key = str(natural_key(acme.id, "payroll-2026-12", f"emp-{n:05d}", _date()))
            copy = jetstream.RowMessage(uuid.UUID(batch["id"]), n, key)
            await js.publish(jetstream.SUBJECT, copy.encode(), headers={jetstream.MSG_ID: key + "-late"})
        last = (await js.stream_info(jetstream.STREAM)).state.last_seq
    finally:
        await nc.close()

    async def drained() -> bool:
        nc2 = await nats.connect(broker.url)
        try:
            i = await nc2.jetstream().consumer_info(jetstream.STREAM, jetstream.DURABLE)
            return i.num_pending == 0 and i.num_ack_pending == 0 and i.ack_floor.stream_seq >= last
        finally:
            await nc2.close()

    await until(drained, "the copies consumed and acknowledged")
    assert each_once(await charges_per_row(db, acme.id, "payroll-2026-12", range(1, 21)))
    assert await unbalanced_payments(db) == []


class NoLeader:
    """A JetStream whose stream has no leader (two nodes of three dead): every publish is answered by nobody."""

    async def publish(self, *args, **kwargs):
        raise nats.errors.NoRespondersError


async def test_rows_the_broker_did_not_acknowledge_wait_a_short_backoff_not_the_whole_claim(
    http, stack, db, acme, database_url
):
    # Would catch: a publish without a PubAck leaving its rows claimed for the whole CLAIM_SECONDS, so a
    # cluster's leader election (seconds) holds a batch back half a minute (seen in `make soak`).
    from datetime import timedelta

    from app.config import Settings
    from app.services import open_services
    from app.workers.batch_publisher import CLAIM_SECONDS, publish_once

    await upload(http, stack.api, acme, csv_file(3))
    settings = Settings(database_url=database_url, psp_url=stack.psp.url, rail_url=stack.rail.url)
    async with open_services(settings) as services:
        stored, unacknowledged = await publish_once(services, NoLeader(), retry_seconds=1.0)
    assert (stored, unacknowledged) == (0, 3)
    waits = await db.fetch("SELECT claimed_until - now() AS left FROM batch_outbox")
    assert len(waits) == 3 and all(w["left"] <= timedelta(seconds=1.5) for w in waits), waits
    assert CLAIM_SECONDS > 10  # what the rows would otherwise have waited
