"""Payment batch uploads refused or replayed before any broker is involved: nothing stored, nothing published.

The rows' payment over the broker, crashes and all, is tests/batches/ (`make test-batches`).
"""

from __future__ import annotations

import json
import uuid
from datetime import date

from sqlalchemy.ext.asyncio import create_async_engine

from app.config import asyncpg_url
from app.db.transaction import atomic
from app.payments.batches import progress
from app.payments.batches.rows import natural_key
from tests.batches.support import csv_file, upload
from tests.support import IBAN, headers, payment_body

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



async def test_a_batch_of_the_wrong_type_or_over_its_cap_is_refused_and_another_clients_batch_is_404(
    http, stack, db, acme, globex
):
    wrong = await upload(http, stack.api, acme, csv_file(2), media_type="application/json")
    assert wrong.status_code == 400 and wrong.json()["type"] == "/problems/invalid-request"
    # Over the route's own cap (and far over the 16 KiB every other route has).
    huge = await upload(http, stack.api, acme, csv_file(2) + b"x" * (4 * 1024 * 1024))
    assert huge.status_code == 413 and huge.json()["type"] == "/problems/payload-too-large"
    # A file of 40 KiB is no payment, and is a batch: over the payment cap, under the batch cap.
    accepted = await upload(http, stack.api, acme, csv_file(400))
    assert accepted.status_code == 202 and len(csv_file(400)) > 16 * 1024
    batch_id = accepted.json()["id"]
    mine = await http.get(f"{stack.api}/v1/payment-batches/{batch_id}", headers=acme.auth)
    assert mine.status_code == 200 and mine.json()["counts"] == {"queued": 400}
    theirs = await http.get(f"{stack.api}/v1/payment-batches/{batch_id}", headers=globex.auth)
    assert theirs.status_code == 404 and theirs.json()["type"] == "/problems/not-found"
    assert await db.fetchval("SELECT count(*) FROM payment_batch") == 1


async def test_payments_batches_submit_stores_a_batch_once_and_says_so_when_run_again(db, acme, processes, tmp_path):
    path = tmp_path / "payroll-2026-11.csv"
    path.write_bytes(csv_file(3))
    code, first = await processes.cli("batches", "submit", str(path), "--client", str(acme.id))
    assert code == 0 and "3 rows accepted" in first and "replayed" not in first, first
    code, again = await processes.cli("batches", "submit", str(path), "--client", str(acme.id))
    assert code == 0 and "replayed" in again, again
    batch = await db.fetchrow("SELECT id, reference, row_count FROM payment_batch")
    assert (batch["reference"], batch["row_count"]) == ("payroll-2026-11", 3) and str(batch["id"]) in again
    assert await db.fetchval("SELECT count(*) FROM batch_outbox") == 3


async def test_a_row_whose_key_names_another_payment_is_not_paid_and_does_not_complete_its_batch(
    http, stack, db, database_url, acme
):
    # The row's natural key was used before for a different payment (an edited
    # file, say): that payment is not the row's. Bug caught: counting the row
    # as paid by whatever its key row names, which completed the batch (and
    # emitted batch.completed) before the row's last delivery dead-lettered it.
    key = natural_key(acme.id, "payroll-2026-12", "emp-00001", date(2026, 12, 24))
    taken = await http.post(stack.api + "/v1/payments", json=payment_body(), headers=headers(acme, str(key)))
    assert taken.status_code == 201 and taken.json()["status"] == "succeeded"
    batch = (await upload(http, stack.api, acme, csv_file(1))).json()

    shown = (await http.get(f"{stack.api}/v1/payment-batches/{batch['id']}", headers=headers(acme, None))).json()
    assert shown["counts"] == {"queued": 1} and shown["status"] == "in_progress"
    engine = create_async_engine(asyncpg_url(database_url))
    try:
        assert await atomic(engine, progress.complete, uuid.UUID(batch["id"])) is None
    finally:
        await engine.dispose()
    assert await db.fetchval("SELECT completed_at FROM payment_batch") is None
    assert await db.fetchval("SELECT count(*) FROM event WHERE type = 'batch.completed'") == 0
