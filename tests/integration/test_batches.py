"""Payment batches: upload, outbox, broker, consumer, completion; judged on the PSP's and rail's records and the ledger.

Each test runs a NATS server of its own (from the wheel, on free ports, its
store in the test's directory) and `payments consume` processes against the
session's API, fakes and database.
"""

from __future__ import annotations

import csv
import io
import json
import uuid

import httpx
import nats
import pytest

from app.broker import jetstream
from app.payments.batches.rows import natural_key, payment_reference
from tests.support import IBAN, headers, unbalanced_payments, until

FAST = {"BATCH_ACK_WAIT_SECONDS": "3", "BACKOFF_BASE_SECONDS": "0.1", "BACKOFF_CAP_SECONDS": "0.5"}


def csv_file(rows: int, *, amount: int = 1250, start: int = 1, value_date: str = "2026-12-24") -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["reference", "value_date", "amount", "currency", "card_token", "beneficiary_name",
                     "beneficiary_iban"])
    for n in range(start, start + rows):
        writer.writerow([f"emp-{n:05d}", value_date, amount + n, "EUR", "tok_visa", f"Employee {n}", IBAN])
    return out.getvalue().encode()


async def upload(http: httpx.AsyncClient, api: str, client, body: bytes, *, reference: str = "payroll-2026-12",
                 key: str | None = None, media_type: str = "text/csv") -> httpx.Response:
    return await http.post(f"{api}/v1/payment-batches", params={"reference": reference}, content=body,
                           headers=headers(client, key or str(uuid.uuid4())) | {"Content-Type": media_type})


@pytest.fixture
async def broker(processes, tmp_path):
    return processes.system.start_nats(tmp_path / "nats")


def consumer(processes, name: str = "consumer", **env: str):
    return processes.system.start_consumer(name, **(FAST | env))


async def completed(http, api, client, batch_id, timeout: float = 60.0) -> dict:
    seen: dict = {}

    async def done() -> bool:
        r = await http.get(f"{api}/v1/payment-batches/{batch_id}", headers=client.auth)
        seen.update(r.json())
        return seen.get("status") == "completed"

    await until(done, f"batch {batch_id} completed", timeout)
    return seen


async def charges_per_row(db, client_id: int, reference: str, rows: range) -> dict[str, int]:
    """For each row, how many charges the PSP holds for its payment reference, and transfers at the rail."""
    refs = [payment_reference(natural_key(client_id, reference, f"emp-{n:05d}", _date())) for n in rows]
    charges = dict(await db.fetch("SELECT reference, count(*) FROM fake_psp.charge WHERE reference = ANY($1::text[])"
                                  " GROUP BY 1", refs))
    transfers = dict(await db.fetch("SELECT reference, count(*) FROM fake_rail.transfer WHERE reference = ANY($1::text[])"
                                    " GROUP BY 1", refs))
    payments = dict(await db.fetch("SELECT reference, count(*) FROM payment WHERE reference = ANY($1::text[])"
                                   " GROUP BY 1", refs))
    return {r: (charges.get(r, 0), transfers.get(r, 0), payments.get(r, 0)) for r in refs}


def _date():
    from datetime import date

    return date(2026, 12, 24)


def each_once(counts: dict) -> bool:
    return all(v == (1, 1, 1) for v in counts.values())


async def test_a_batch_is_paid_once_per_row_and_completed_once(http, stack, db, acme, broker, processes):
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
    # Each row's key is its natural key, and its payment's reference derives from it.
    key = natural_key(acme.id, "payroll-2026-12", "emp-00007", _date())
    row = await db.fetchrow("SELECT k.state, p.reference FROM idempotency_key k JOIN payment p ON p.id = k.payment_id"
                            " WHERE k.client_id = $1 AND k.key = $2", acme.id, str(key))
    assert row["state"] == "finished" and row["reference"] == payment_reference(key)


async def test_a_file_with_bad_rows_is_refused_whole_with_every_bad_row_listed(http, stack, db, acme):
    rows = csv_file(5).decode().splitlines()
    rows[2] = rows[2].replace(",EUR,", ",XXX,")  # row 2: a currency we do not settle
    rows[4] = rows[4].replace("2026-12-24", "24/12/2026")  # row 4: not a date
    rows.append(rows[1])  # row 6: the same reference and value date as row 1
    response = await upload(http, stack.api, acme, ("\n".join(rows) + "\n").encode())
    assert response.status_code == 400 and response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["type"] == "/problems/invalid-batch"
    assert [(e["row"], e["field"]) for e in problem["errors"]] == [(2, "currency"), (4, "value_date"), (6, "reference")]
    for table in ("payment_batch", "payment_batch_row", "batch_outbox", "idempotency_key"):
        assert await db.fetchval(f"SELECT count(*) FROM {table}") == 0, table


async def test_json_lines_are_a_batch_too_and_the_upload_replays_under_its_key(http, stack, db, acme):
    lines = [json.dumps({"reference": f"inv-{n}", "value_date": "2026-12-24", "amount": 5000, "currency": "EUR",
                         "card_token": "tok_visa", "beneficiary": {"name": "Ada", "iban": IBAN}}) for n in range(3)]
    body = ("\n".join(lines) + "\n").encode()
    first = await upload(http, stack.api, acme, body, key="upload-1", media_type="application/x-ndjson")
    again = await upload(http, stack.api, acme, body, key="upload-1", media_type="application/x-ndjson")
    assert first.status_code == again.status_code == 202
    assert again.content == first.content and again.headers["Idempotent-Replayed"] == "true"
    other = await upload(http, stack.api, acme, body.replace(b"5000", b"6000"), key="upload-1",
                         media_type="application/x-ndjson")
    assert other.status_code == 422 and other.json()["type"] == "/problems/idempotency-key-reused"
    assert await db.fetchval("SELECT count(*) FROM payment_batch") == 1
    assert await db.fetchval("SELECT count(*) FROM payment_batch_row") == 3


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
    from tests.support import payment_body

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
