"""Recording webhook attempts in batches: every row of one statement is fenced by its own lease.

The dispatcher records all the attempts that finished since its last record
in one statement (app/workers/webhooks.py::Recorder,
app/outbox/delivery.py::record). That is only safe if each row is still
fenced by its own lease token: a delivery claimed again by another
dispatcher (our lease ran out while we stalled) must keep what that one
writes, however many of our other attempts share the statement.

No dispatcher runs here: the test claims and records with the same
functions the dispatcher calls, against the session's real database, and
reads the delivery and attempt rows.
"""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import pytest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import create_async_engine

from app.config import asyncpg_url
from app.db.transaction import one_statement
from app.outbox import delivery
from app.outbox.delivery import Answer, Attempted, Decision, LeaseLost
from app.outbox.sealing import SecretsKey
from app.workers import webhooks
from app.workers.webhooks import Recorder
from tests.conftest import SECRETS_KEY, seal
from tests.support import behind_every_running_transaction, headers, payment_body


@pytest.fixture
async def engine(database_url):
    engine = create_async_engine(asyncpg_url(database_url))
    yield engine
    await engine.dispose()


@pytest.fixture
async def claimed(http, stack, db, clean, acme, engine) -> list[delivery.Claimed]:
    """Three of acme's deliveries, leased to "us" (acme's endpoint is never called: no dispatcher runs).

    As a batch behind the cursor leaves them when it moves on while their
    first attempts are still in flight: a pending row each, leased, with its
    attempt row open. That is also where a retry's claim leaves its rows.
    """
    await db.execute("INSERT INTO webhook_endpoint (client_id, url, secret_sealed) VALUES ($1, $2, $3)",
                     acme.id, "http://127.0.0.1:9/never-called", seal("whsec_" + "A" * 32))
    for _ in range(3):
        response = await http.post(f"{stack.api}/v1/payments", json=payment_body(),
                                   headers=headers(acme, str(uuid.uuid4())))
        assert response.status_code == 201, response.text
    await behind_every_running_transaction(db)
    batch = await one_statement(engine, delivery.take, limit=10, lease_seconds=30, key=SecretsKey(SECRETS_KEY))
    assert batch is not None and len(batch.to_send) == 3
    assert await one_statement(engine, delivery.move, batch, [], batch.to_send, lease_seconds=30)
    rows = await db.fetch("SELECT state, lease_token, attempts FROM webhook_delivery")
    assert [tuple(r) for r in rows] == [("pending", batch.token, 1)] * 3
    return sorted(batch.to_send, key=lambda c: c.event_id)


async def taken_over(db, claimed: delivery.Claimed) -> uuid.UUID:
    """Another dispatcher's claim of the same delivery, as after our lease ran out: a new token."""
    return await db.fetchval(
        "UPDATE webhook_delivery SET lease_token = gen_random_uuid(), attempts = attempts + 1 "
        "WHERE event_id = $1 RETURNING lease_token", claimed.event_id)


def delivered(claimed: delivery.Claimed) -> Attempted:
    return Attempted(claimed, Answer(200, 12.5, None), Decision(delivery.DELIVERED))


async def test_a_batch_records_every_attempt_whose_lease_it_still_holds_and_nothing_of_the_one_taken_over(
    db, engine, claimed
):
    ours_a, lost, ours_b = claimed
    their_token = await taken_over(db, lost)

    recorded = await one_statement(engine, delivery.record, [delivered(c) for c in claimed])

    assert recorded == {ours_a.event_id, ours_b.event_id}
    for c in (ours_a, ours_b):
        row = await db.fetchrow("SELECT * FROM webhook_delivery WHERE event_id = $1", c.event_id)
        assert (row["state"], row["lease_token"], row["last_status"]) == ("delivered", None, 200)
        [attempt] = await db.fetch("SELECT * FROM webhook_attempt WHERE event_id = $1", c.event_id)
        assert (attempt["outcome"], attempt["status_code"], attempt["latency_ms"]) == ("delivered", 200, 12.5)
        assert attempt["finished_at"] is not None
    row = await db.fetchrow("SELECT * FROM webhook_delivery WHERE event_id = $1", lost.event_id)
    assert (row["state"], row["lease_token"], row["last_status"]) == ("pending", their_token, None), \
        "the other dispatcher's lease and state are untouched"
    unfinished = await db.fetchval(
        "SELECT count(*) FROM webhook_attempt WHERE event_id = $1 AND finished_at IS NULL", lost.event_id)
    assert unfinished == 1, "our attempt of the taken-over delivery is not marked finished"


async def test_the_recorder_tells_each_waiting_delivery_its_own_outcome(db, engine, claimed):
    ours_a, lost, ours_b = claimed
    await taken_over(db, lost)
    recorder = Recorder(SimpleNamespace(engine=engine), in_flight=lambda: len(claimed))
    recording = asyncio.create_task(recorder.run())
    try:
        # Handed over together, so they share statements.
        results = await asyncio.gather(*(recorder.record(delivered(c)) for c in claimed), return_exceptions=True)
    finally:
        recording.cancel()
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], LeaseLost) and str(lost.event_id) in str(results[1])
    states = dict(await db.fetch("SELECT event_id, state FROM webhook_delivery"))
    assert states == {ours_a.event_id: "delivered", lost.event_id: "pending", ours_b.event_id: "delivered"}


async def test_an_attempt_finishing_while_others_are_in_flight_waits_to_share_their_statement(
        db, engine, claimed, monkeypatch):
    # A linger long enough that the second attempt surely arrives within it
    # on a loaded machine; the test does not wait for it to pass by a clock.
    monkeypatch.setattr(webhooks, "RECORD_LINGER_SECONDS", 0.5)
    statements: list[str] = []
    event.listen(engine.sync_engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    first, second, _ = claimed
    recorder = Recorder(SimpleNamespace(engine=engine), in_flight=lambda: 2)
    recording = asyncio.create_task(recorder.run())
    async def a_moment_later(attempt: Attempted) -> None:
        for _ in range(5):  # a few turns of the loop: the recorder has taken the first one by then
            await asyncio.sleep(0)
        await recorder.record(attempt)

    try:
        await asyncio.gather(recorder.record(delivered(first)), a_moment_later(delivered(second)))
    finally:
        recording.cancel()
    assert len(statements) == 1, "both attempts went into one record statement"
    states = dict(await db.fetch("SELECT event_id, state FROM webhook_delivery"))
    assert (states[first.event_id], states[second.event_id]) == ("delivered", "delivered")
