"""A webhook's first attempt is read behind a cursor: it skips nothing, and writes its rows only when it moves.

The dispatcher reads the events after `webhook_cursor` in the order of the
transactions that wrote them, POSTs them, and moves the cursor past them in
one statement that also writes each attempt's delivery row
(app/outbox/delivery.py: `take`, `move`). What must hold: a payment writes
its event and nothing more for its webhook; the cursor never moves past an
event whose transaction had not ended when it read (or that event is never
sent); a batch moved by a dispatcher whose lease was taken over writes
nothing; each row is written as its attempt left it.

No dispatcher runs here: the tests read and move with the functions the
dispatcher calls, against the session's real database, and read the rows.
"""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import create_async_engine

from app.config import asyncpg_url
from app.db.driver import DRIVER_STATEMENTS
from app.db.transaction import one_statement
from app.outbox import delivery
from app.outbox.delivery import Answer, Attempted, Decision
from app.outbox.sealing import SecretsKey
from tests.conftest import SECRETS_KEY, seal
from tests.support import behind_every_running_transaction, headers, payment_body, until


KEY = SecretsKey(SECRETS_KEY)


# Every test here runs both ways `take` and `move` can be sent: to asyncpg
# itself (the optimisation of app/db/driver.py, the service's default) and
# through SQLAlchemy (REPLAY_SHORTCUT=false).
@pytest.fixture(params=[True, False], ids=["driver", "sqlalchemy"])
async def engine(database_url, request):
    engine = create_async_engine(asyncpg_url(database_url), execution_options={DRIVER_STATEMENTS: request.param})
    yield engine
    await engine.dispose()


@pytest.fixture
async def endpoint(db, acme) -> None:
    """acme gets an endpoint that is never called (no dispatcher runs)."""
    await db.execute("INSERT INTO webhook_endpoint (client_id, url, secret_sealed) VALUES ($1, $2, $3)",
                     acme.id, "http://127.0.0.1:9/never-called", seal("whsec_" + "A" * 32))


async def take(engine, limit: int = 50) -> delivery.Batch | None:
    return await one_statement(engine, delivery.take, limit=limit, lease_seconds=30, key=KEY)


async def move(engine, batch, finished=(), in_flight=()) -> bool:
    return await one_statement(engine, delivery.move, batch, list(finished), list(in_flight), lease_seconds=30)


async def batch_event(conn: asyncpg.Connection, client_id: int) -> uuid.UUID:
    """An event written as a batch's completion is (it names no payment): the smallest event there is."""
    return await conn.fetchval(
        "INSERT INTO event (client_id, type, data) VALUES ($1, 'batch.completed', '{}') RETURNING id", client_id)


async def move_cursor_past(conn: asyncpg.Connection, event_id: uuid.UUID) -> None:
    """The cursor where a dispatcher leaves it once it has sent `event_id`."""
    await conn.execute("UPDATE webhook_cursor SET (written_by, event_id) = "
                       "(SELECT written_by, id FROM event WHERE id = $1)", event_id)


async def read_counted(engine, limit: int) -> tuple[delivery.Batch | None, int]:
    """A read behind the cursor, rolled back: its batch, and how many events it fetched to make it."""
    async with engine.connect() as conn:  # one transaction: its own counters are the read's
        # A table this small may be read whole, which is right for it; the
        # question is how the cursor's index is scanned, as on a large table.
        await conn.execute(text("SET LOCAL enable_seqscan = off"))
        await conn.execute(text("SET LOCAL enable_bitmapscan = off"))
        batch = await delivery.take(conn, limit=limit, lease_seconds=30, key=KEY)
        # Entries the scans of the cursor's index returned, and rows a sequential scan of `event` read.
        fetched = await conn.scalar(text("SELECT pg_stat_get_xact_tuples_returned('event_written_by'::regclass) "
                                         "+ pg_stat_get_xact_tuples_returned('event'::regclass)"))
        await conn.rollback()
    return batch, fetched


async def test_a_payment_writes_its_event_only_and_the_cursor_sends_those_of_clients_with_an_endpoint(
    http, stack, db, engine, endpoint, acme, globex
):
    ids = {}
    for client in (acme, globex):
        response = await http.post(f"{stack.api}/v1/payments", json=payment_body(),
                                   headers=headers(client, str(uuid.uuid4())))
        assert response.status_code == 201, response.text
        ids[client.id] = await db.fetchval("SELECT id FROM event WHERE payment_id = $1",
                                           uuid.UUID(response.json()["id"]))
    assert await db.fetchval("SELECT count(*) FROM webhook_delivery") == 0, "nothing but the event on the payment path"
    assert await db.fetchval("SELECT count(*) FROM event WHERE written_by IS NULL") == 0

    await behind_every_running_transaction(db)
    batch = await take(engine)

    assert batch is not None and not batch.full
    assert [c.event_id for c in batch.to_send] == [ids[acme.id]], "globex has no endpoint: it reads the feed"
    assert batch.to_send[0].secret == "whsec_" + "A" * 32 and batch.to_send[0].attempt == 1
    assert await take(engine) is None, "the cursor is leased: nobody else reads this batch"
    assert await move(engine, batch)
    assert await take(engine) is None, "the cursor is past both events"
    cursor = await db.fetchrow("SELECT event_id, lease_token FROM webhook_cursor")
    assert tuple(cursor) == (ids[globex.id], None), "moved to the last event read, written by the later transaction"
    assert await db.fetchval("SELECT count(*) FROM webhook_delivery") == 0, "a batch with no attempt writes no row"


async def test_the_cursor_never_moves_past_an_event_whose_transaction_is_still_open(
    db, database_url, engine, endpoint, acme
):
    """An event inserted first and committed last is still sent: the cursor waits for its transaction."""
    slow = await asyncpg.connect(database_url)
    try:
        transaction = slow.transaction()
        await transaction.start()
        first = await batch_event(slow, acme.id)  # its transaction began first, and stays open
        second = await batch_event(db, acme.id)  # committed at once, by a later transaction

        # The second event is committed and visible, but its transaction is
        # younger than one still running: the cursor does not read it yet.
        early = await take(engine)
        if early is not None:  # only what is older than the open transaction (nothing of ours)
            assert second not in [c.event_id for c in early.to_send]
            assert await move(engine, early)
        await transaction.commit()
    finally:
        await slow.close()

    await behind_every_running_transaction(db)
    sent = []
    while (batch := await take(engine)) is not None:
        sent += [c.event_id for c in batch.to_send]
        assert await move(engine, batch)
    assert sent == [first, second], "both, in the order of their transactions"


async def test_a_batch_moved_after_its_lease_was_taken_over_writes_nothing(db, engine, endpoint, acme):
    event_id = await batch_event(db, acme.id)
    await behind_every_running_transaction(db)
    ours = await take(engine)
    assert ours is not None
    # Our lease ran out; another dispatcher took the cursor and holds it now.
    theirs = await db.fetchval("UPDATE webhook_cursor SET lease_token = gen_random_uuid(), "
                               "lease_expires_at = now() + interval '30 seconds' RETURNING lease_token")

    claimed = ours.to_send[0]
    delivered = Attempted(claimed, Answer(200, 5.0, None), Decision(delivery.DELIVERED))
    assert not await move(engine, ours, finished=[delivered])

    cursor = await db.fetchrow("SELECT written_by::text, event_id, lease_token FROM webhook_cursor")
    assert tuple(cursor) == ("0", uuid.UUID(int=0), theirs), "not moved, and their lease stands"
    assert await db.fetchval("SELECT count(*) FROM webhook_delivery WHERE event_id = $1", event_id) == 0
    assert await db.fetchval("SELECT count(*) FROM webhook_attempt") == 0


async def test_a_moved_batch_writes_each_attempts_rows_as_the_attempt_left_them(db, engine, endpoint, acme):
    ids = [await batch_event(db, acme.id) for _ in range(4)]
    await behind_every_running_transaction(db)
    batch = await take(engine)
    assert batch is not None and [c.event_id for c in batch.to_send] == ids
    ok, refused, gone, slow = batch.to_send
    finished = [
        Attempted(ok, Answer(200, 5.0, None), Decision(delivery.DELIVERED)),
        Attempted(refused, Answer(503, 7.0, "http_status", "HTTP 503"), Decision(delivery.RETRY, 60.0)),
        Attempted(gone, Answer(410, 3.0, "http_status", "HTTP 410"), Decision(delivery.DEAD)),
    ]

    assert await move(engine, batch, finished=finished, in_flight=[slow])

    rows = {r["event_id"]: r for r in await db.fetch(
        "SELECT *, next_attempt_at - now() AS due_in FROM webhook_delivery")}
    assert (rows[ok.event_id]["state"], rows[ok.event_id]["last_status"]) == ("delivered", 200)
    assert rows[ok.event_id]["delivered_at"] is not None
    assert (rows[refused.event_id]["state"], rows[refused.event_id]["last_error"]) == ("pending", "HTTP 503")
    assert rows[refused.event_id]["lease_token"] is None
    assert 55 < rows[refused.event_id]["due_in"].total_seconds() <= 60, "due again after its backoff"
    assert rows[gone.event_id]["state"] == "dead"
    assert (rows[slow.event_id]["state"], rows[slow.event_id]["lease_token"]) == ("pending", batch.token), \
        "still in flight: leased to us, recorded as a retry's attempt is"
    assert {r["attempts"] for r in rows.values()} == {1}
    attempts = {r["event_id"]: r for r in await db.fetch("SELECT * FROM webhook_attempt")}
    assert [(attempts[c.event_id]["attempt"], attempts[c.event_id]["outcome"]) for c in batch.to_send] == [
        (1, "delivered"), (1, "retry"), (1, "dead"), (1, None)]
    assert attempts[slow.event_id]["finished_at"] is None and attempts[ok.event_id]["finished_at"] is not None
    cursor = await db.fetchrow("SELECT * FROM webhook_cursor")
    assert (cursor["event_id"], cursor["lease_token"]) == (ids[-1], None)

    # The one still in flight ends: recorded through its row's lease, as a retry's attempt.
    recorded = await one_statement(engine, delivery.record, [
        Attempted(slow, Answer(200, 1500.0, None), Decision(delivery.DELIVERED))])
    assert recorded == {slow.event_id}
    assert await db.fetchval("SELECT state FROM webhook_delivery WHERE event_id = $1", slow.event_id) == "delivered"
    # The retry is claimed from its row when due, and not before.
    assert await one_statement(engine, delivery.claim, limit=10, lease_seconds=30, key=KEY) == []


async def test_a_batch_with_no_slot_left_stops_before_the_next_event_to_send(db, engine, endpoint, acme, globex):
    """Events passed over (no endpoint) do not take slots; the cursor stops just before the first one not sent."""
    written = [await batch_event(db, client.id) for client in (acme, globex, acme, globex, acme)]
    await behind_every_running_transaction(db)

    first = await take(engine, limit=2)
    assert first is not None and first.full
    assert [c.event_id for c in first.to_send] == [written[0], written[2]]
    assert await move(engine, first)
    assert await db.fetchval("SELECT event_id FROM webhook_cursor") == written[3], "past globex's, not acme's third"

    second = await take(engine, limit=2)
    assert second is not None and not second.full
    assert [c.event_id for c in second.to_send] == [written[4]]


async def test_a_batch_ends_at_its_last_post_where_an_endpoint_takes_lists(db, engine, endpoint, acme, globex):
    """acme's events go one a POST, globex's in lists of 3: three POSTs carry five events, and the cursor stops there.

    Bug caught: a read that counts events against its POSTs (as until
    2026-12-05) stops after three events; one that counts a POST for each
    of a list's events too; one that cuts the lists otherwise than the
    dispatcher's `together` sends more POSTs than its slots.
    """
    await db.execute("INSERT INTO webhook_endpoint (client_id, url, secret_sealed, events_per_post) "
                     "VALUES ($1, $2, $3, 3)", globex.id, "http://127.0.0.1:9/never-called", seal("whsec_" + "B" * 32))
    order = (globex, acme, globex, globex, globex, acme, globex)
    written = [await batch_event(db, client.id) for client in order]
    await behind_every_running_transaction(db)
    guessed_low, _ = await read_counted(engine, limit=3)  # rolled back
    assert [c.event_id for c in guessed_low.to_send] == written[:3], \
        "asked for an event a POST, three POSTs' read stops at three events"

    first = await one_statement(engine, delivery.take, limit=3, per_post=3, lease_seconds=30, key=KEY)
    assert first is not None and first.full, "acme's second event would be a fourth POST"
    assert [[c.event_id for c in post] for post in delivery.together(first.to_send)] == [
        written[0:1] + written[2:4], written[1:2], written[4:5]]
    assert await move(engine, first)
    assert await db.fetchval("SELECT event_id FROM webhook_cursor") == written[4]

    second = await take(engine, limit=3)
    assert second is not None and not second.full
    assert [c.event_id for c in second.to_send] == written[5:]


async def test_a_read_that_waited_for_a_move_does_not_lease_the_batch_it_read_before_it(
    db, database_url, engine, endpoint, acme
):
    """Two dispatchers at once: the one that read the cursor while the other moved it sends nothing twice."""
    sent = await batch_event(db, acme.id)
    await behind_every_running_transaction(db)
    mover = await asyncpg.connect(database_url)
    try:
        moving = mover.transaction()
        await moving.start()
        # The other dispatcher's move, not committed yet: it holds the cursor's row.
        await move_cursor_past(mover, sent)
        reading = asyncio.create_task(take(engine))

        async def waiting() -> bool:
            return bool(await db.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query LIKE '%webhook_cursor%'"))

        await until(waiting, "the read to wait for the cursor's row")
        await moving.commit()
        assert await reading is None, "it read the event before the move, and must not send it again"
    finally:
        await mover.close()
    assert await db.fetchval("SELECT lease_token FROM webhook_cursor") is None


async def test_a_read_starts_at_the_cursor_and_reads_no_event_behind_it(db, engine, endpoint, acme):
    """The cursor is where the index scan starts: a read costs its batch, not the table's history."""
    written = [await batch_event(db, acme.id) for _ in range(120)]
    await move_cursor_past(db, written[109])
    await behind_every_running_transaction(db)

    batch, fetched = await read_counted(engine, limit=50)

    assert batch is not None and [c.event_id for c in batch.to_send] == written[110:]
    # The ten after the cursor, and the first of them once more by the
    # lease's check that there is something to read.
    assert fetched == 11, "only the ten events after the cursor were read"


async def test_a_read_stops_at_the_first_event_it_has_no_slot_for(db, engine, endpoint, acme):
    """Two slots may look at eight events (READ_AHEAD); where every event is a webhook to send, it reads four.

    Bug caught: the read joins every event it may look at before its
    running count cuts the batch (as it did until the count could stop the
    scan), so that where most events are webhooks it looks up and discards
    four times what it sends.
    """
    before = await batch_event(db, acme.id)
    written = [await batch_event(db, acme.id) for _ in range(20)]
    await move_cursor_past(db, before)
    await behind_every_running_transaction(db)

    batch, fetched = await read_counted(engine, limit=2)

    assert batch is not None and batch.full
    assert [c.event_id for c in batch.to_send] == written[:2]
    # The two sent, the third (no slot for it: the count stops there), one
    # more that PostgreSQL's window reads ahead of the row it counts, and
    # the first once more by the lease's check. Before the count could stop
    # the scan, all eight.
    assert fetched == 5, f"{fetched} events read for a batch of two"


async def test_an_event_that_already_has_a_delivery_row_is_passed_over_not_sent_again(db, engine, endpoint, acme):
    """A person asked for a delivery before the cursor reached the event: that row is its delivery, a retry's to make.

    Bug caught: the read cannot tell which events have a delivery row (as
    when its lookup of the row is broken), and the cursor sends a first
    attempt beside the retry already due.
    """
    asked, plain = await batch_event(db, acme.id), await batch_event(db, acme.id)
    await db.execute("INSERT INTO webhook_delivery (event_id, client_id) VALUES ($1, $2)", asked, acme.id)
    await behind_every_running_transaction(db)

    batch = await take(engine)

    assert batch is not None and [c.event_id for c in batch.to_send] == [plain]
    assert await move(engine, batch)
    assert await db.fetchval("SELECT count(*) FROM webhook_attempt WHERE event_id = $1", asked) == 0
    assert await db.fetchval("SELECT event_id FROM webhook_cursor") == plain, "passed over, and behind the cursor"


async def test_a_read_looks_up_each_events_delivery_row_by_its_key_however_many_rows_there_are(
    db, engine, endpoint, acme
):
    """A read costs its batch, not the delivery table's history: no scan of every delivery row.

    Bug caught: the read asked EXISTS (a delivery row for this event), and
    with its plan made for any batch size PostgreSQL scanned every delivery
    row into a hash table on each read, so a long-running dispatcher's reads
    grew with every webhook it had ever delivered.
    """
    history = [await batch_event(db, acme.id) for _ in range(400)]
    await db.execute("INSERT INTO webhook_delivery (event_id, client_id, state, attempts, delivered_at) "
                     "SELECT id, client_id, 'delivered', 1, now() FROM event WHERE id = ANY($1::uuid[])", history)
    await move_cursor_past(db, history[-1])
    new = [await batch_event(db, acme.id) for _ in range(10)]
    await db.execute("ANALYZE webhook_delivery")
    await behind_every_running_transaction(db)

    async with engine.connect() as conn:  # one transaction: its own counters are the read's
        # A plan made once for any parameters, as on the service's connections (app/db/engine.py).
        await conn.execute(text("SET LOCAL plan_cache_mode = force_generic_plan"))
        batch = await delivery.take(conn, limit=50, lease_seconds=30, key=KEY)
        # Rows that sequential scans of webhook_delivery read.
        scanned = await conn.scalar(text("SELECT pg_stat_get_xact_tuples_returned('webhook_delivery'::regclass)"))
        await conn.rollback()

    assert batch is not None and [c.event_id for c in batch.to_send] == new
    assert scanned == 0, "every delivery row was read to learn which of ten events have one"


async def test_the_cursors_statements_go_to_the_driver_only_when_it_is_allowed(db, engine, endpoint, acme):
    # Bug caught: the optimisation silently never applies to the dispatcher's
    # statements (or applies with REPLAY_SHORTCUT=false, which must switch
    # every optimisation off).
    sent: list[str] = []
    event.listen(engine.sync_engine, "before_cursor_execute", lambda conn, cursor, sql, *rest: sent.append(sql))
    await batch_event(db, acme.id)
    await behind_every_running_transaction(db)

    batch = await take(engine)
    assert batch is not None and len(batch.to_send) == 1
    assert await move(engine, batch, finished=[Attempted(batch.to_send[0], Answer(200, 1.0, None),
                                                         Decision(delivery.DELIVERED))])

    assert await db.fetchval("SELECT state FROM webhook_delivery") == "delivered"
    on = engine.sync_engine.get_execution_options()[DRIVER_STATEMENTS]
    cursor_statements = [sql for sql in sent if "webhook_cursor" in sql]
    assert len(cursor_statements) == (0 if on else 2)
