"""Batch consumers and the broker killed on purpose: every row paid once, judged on the PSP's and rail's records and the ledger.

Real processes: `payments consume` (SIGKILLed, or dying at a crash point
with os._exit) and the NATS server (SIGKILLed and started again on its
store). Small batches, so each test takes seconds; the 1,000-row run is
`make test-batches-1000` (the mid-batch kill with BATCH_ROWS=1000).
"""

from __future__ import annotations

import os
import uuid

import pytest

from tests.batches.support import (
    charges_per_row, completed, consumer, csv_file, each_once, upload,
)
from tests.batches.support import broker  # noqa: F401  (a fixture: a NATS server of the test's own)
from tests.support import unbalanced_payments, until


async def linked(db, batch_id: str) -> int:
    return await db.fetchval("SELECT count(*) FROM payment_batch_row WHERE batch_id = $1 AND payment_id IS NOT NULL",
                             uuid.UUID(batch_id))


async def all_paid_once(http, stack, db, client, batch: dict, rows: int, timeout: float = 120) -> None:
    done = await completed(http, stack.api, client, batch["id"], timeout=timeout)
    assert done["counts"] == {"succeeded": rows}, done
    assert each_once(await charges_per_row(db, client.id, "payroll-2026-12", range(1, rows + 1)))
    assert await unbalanced_payments(db) == []


async def test_a_consumer_killed_after_commit_before_ack_is_answered_by_replay(http, stack, db, acme, broker, processes):
    batch = (await upload(http, stack.api, acme, csv_file(20))).json()
    dying = consumer(processes, "dying", PAYMENTS_CRASH_AT="after-commit-finished", BATCH_CONSUMER_CONCURRENCY="1")
    assert dying.wait(60) == 137
    # One row's payment finished and committed; its message was never acknowledged.
    finished = await db.fetchval("SELECT count(*) FROM idempotency_key WHERE endpoint = 'POST /v1/payments'"
                                 " AND state = 'finished'")
    assert finished == 1 and await linked(db, batch["id"]) == 0
    consumer(processes, "after")
    await all_paid_once(http, stack, db, acme, batch, 20)


async def test_a_consumer_killed_before_commit_is_resumed_from_its_recovery_point(
    http, stack, db, acme, broker, processes
):
    batch = (await upload(http, stack.api, acme, csv_file(20))).json()
    dying = consumer(processes, "dying", PAYMENTS_CRASH_AT="after-call-EXT1", BATCH_CONSUMER_CONCURRENCY="1",
                     LEASE_SECONDS="2")
    assert dying.wait(60) == 137
    # The PSP charged one row; the charge is not recorded: the key row still says EXT1_SENT.
    assert await db.fetchval("SELECT count(*) FROM fake_psp.charge") == 1
    assert await db.fetchval("SELECT count(*) FROM idempotency_key WHERE recovery_point = 'EXT1_SENT'") == 1
    consumer(processes, "after", LEASE_SECONDS="2")
    await all_paid_once(http, stack, db, acme, batch, 20)
    resumed = await db.fetchval("SELECT count(*) FROM idempotency_key WHERE attempts > 1")
    assert resumed == 1  # taken over, probed, the charge found and recorded: not charged again


@pytest.mark.timeout(180 + int(os.environ.get("BATCH_ROWS", "50")) // 2)
async def test_a_consumer_killed_mid_batch_with_rows_in_flight_leaves_every_row_paid_once(
    http, stack, db, acme, broker, processes
):
    rows = int(os.environ.get("BATCH_ROWS", "50"))  # `make test-batches-1000`: 1,000
    batch = (await upload(http, stack.api, acme, csv_file(rows))).json()
    first = consumer(processes, "first", BATCH_CONSUMER_CONCURRENCY="16", LEASE_SECONDS="3")

    async def some_paid() -> bool:
        return await linked(db, batch["id"]) >= rows // 5

    await until(some_paid, "a fifth of the rows paid", timeout=60 + rows / 5)
    first.kill()
    consumer(processes, "second", LEASE_SECONDS="3")
    await all_paid_once(http, stack, db, acme, batch, rows, timeout=120 + rows)


async def test_the_broker_restarted_during_a_batch_loses_nothing_and_pays_nothing_twice(
    http, stack, db, acme, broker, processes
):
    batch = (await upload(http, stack.api, acme, csv_file(40))).json()
    consumer(processes, BATCH_CONSUMER_CONCURRENCY="4")

    async def some_paid() -> bool:
        return await linked(db, batch["id"]) >= 5

    await until(some_paid, "five rows paid")
    broker.process.kill()
    broker.process.start()  # the same port and store: what it had stored, it has
    await all_paid_once(http, stack, db, acme, batch, 40)


async def test_two_consumers_on_one_stream_pay_each_row_once(http, stack, db, acme, broker, processes):
    both = [consumer(processes, name, BATCH_CONSUMER_CONCURRENCY="4") for name in ("one", "two")]
    batch = (await upload(http, stack.api, acme, csv_file(40))).json()  # both are up and fetching
    await all_paid_once(http, stack, db, acme, batch, 40)
    # The precondition that makes this a test of two consumers: each paid some rows.
    assert all("payment finished" in c.log.read_text() for c in both), [c.tail() for c in both]
    assert await db.fetchval("SELECT count(*) FROM event WHERE type = 'batch.completed'") == 1
