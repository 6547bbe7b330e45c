"""The single-statement phases, called directly: the fence really fences.

A phase folded into one statement must behave exactly like the transaction
it replaces. Here each is called with a lease that is no longer the owner's,
and must change no row at all: not the key row, not the payment, not the
ledger.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from datetime import timedelta

import pytest
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import create_async_engine

from app.config import asyncpg_url
from app.db.driver import DRIVER_STATEMENTS
from app.db.engine import install_listeners
from app.db.errors import database_unavailable
from app.db.transaction import atomic, one_statement
from app.idempotency.key_table import Lease, LeaseLost
from app.machine import engine as machine_engine
from app.machine.declare import Operation
from app.payments import payment_table, phases
from app.payments.machines import BY_ENDPOINT
from app.payments.payment import PAYMENT
from app.payments.models import PaymentRequest
from app.problems import DUPLICATE_PAYMENT, ProblemError
from app.rails.answers import Charge, Refund, Transfer
from tests.support import payment_body


# Every test here runs both ways a phase's statement can be sent: to asyncpg
# itself (the optimisation of app/db/driver.py, the service's default) and
# through SQLAlchemy (REPLAY_SHORTCUT=false).
@pytest.fixture(params=[True, False], ids=["driver", "sqlalchemy"])
async def engine(database_url, request):
    engine = create_async_engine(asyncpg_url(database_url), execution_options={DRIVER_STATEMENTS: request.param})
    install_listeners(engine)
    yield engine
    await engine.dispose()


async def snapshot(db, key: str):
    return (
        await db.fetchrow("SELECT * FROM idempotency_key WHERE key = $1", key),
        await db.fetch("SELECT * FROM payment"),
        await db.fetch("SELECT * FROM ledger_entry"),
    )


async def new_operation(engine, acme, key: str) -> Operation:
    request = PaymentRequest.model_validate(payment_body())
    op = await one_statement(
        engine, phases.handler1, PAYMENT, client_id=acme.id, key=key, request_hash=b"h", request=request, lease_seconds=30
    )
    assert op is not None and op.recovery_point == "EXT1_SENT"
    return op


@pytest.mark.parametrize(
    "phase, outcome",
    [
        (phases.record_charge, Charge(id="ch_1", status="succeeded")),
        (phases.record_charge, Charge(id="ch_1", status="declined", decline_code="card_declined")),
        (phases.record_transfer, Transfer(id="tr_1", status="accepted")),
        (phases.record_transfer, Transfer(id="tr_1", status="rejected", reject_reason="account_closed")),
        (phases.record_refund, Refund(id="re_1", status="succeeded")),
    ],
)
async def test_a_phase_run_under_a_lease_that_was_taken_over_writes_nothing(engine, db, acme, phase, outcome):
    key = str(uuid.uuid4())
    op = await new_operation(engine, acme, key)
    stale = replace(op, lease=Lease(acme.id, key, uuid.uuid4(), op.lease.stored_on))
    before = await snapshot(db, key)

    with pytest.raises(LeaseLost):
        await one_statement(engine, phase, stale, outcome, 30)

    assert await snapshot(db, key) == before


async def test_the_lease_names_the_key_rows_day_and_a_row_moved_to_another_day_fences_its_old_owner_off(
    engine, db, acme
):
    key = str(uuid.uuid4())
    op = await new_operation(engine, acme, key)
    stored = await db.fetchrow("SELECT stored_on FROM idempotency_key WHERE key = $1", key)
    assert op.lease.stored_on == stored["stored_on"]

    # What the reaper does to a row whose lease has run out: move it to
    # another day's partition (one that exists: the days ahead are created).
    later = stored["stored_on"] + timedelta(days=1)
    await db.execute("UPDATE idempotency_key SET stored_on = $2 WHERE key = $1", key, later)
    before = await snapshot(db, key)

    with pytest.raises(LeaseLost):
        await one_statement(engine, phases.record_charge, op, Charge(id="ch_1", status="succeeded"), 30)
    assert await snapshot(db, key) == before

    # The same token naming the row's new day is the owner again.
    moved = replace(op, lease=replace(op.lease, stored_on=later))
    advanced = await one_statement(engine, phases.record_charge, moved, Charge(id="ch_1", status="succeeded"), 30)
    assert advanced.recovery_point == "EXT2_SENT"


async def test_the_owner_advances_and_its_posting_balances(engine, db, acme):
    key = str(uuid.uuid4())
    op = await new_operation(engine, acme, key)

    op = await one_statement(engine, phases.record_charge, op, Charge(id="ch_1", status="succeeded"), 30)

    assert op.recovery_point == "EXT2_SENT" and op.subject.psp_charge_id == "ch_1"
    row = await db.fetchrow("SELECT recovery_point, lease_token FROM idempotency_key WHERE key = $1", key)
    assert row["recovery_point"] == "EXT2_SENT" and row["lease_token"] == op.lease.token
    legs = await db.fetch("SELECT debit_minor, credit_minor FROM ledger_entry WHERE payment_id = $1", op.subject.id)
    assert len(legs) == 3 and sum(r["debit_minor"] for r in legs) == sum(r["credit_minor"] for r in legs)


@pytest.mark.parametrize(
    "outcomes",
    [
        [Charge(id="ch_1", status="succeeded"), Transfer(id="tr_1", status="accepted")],
        [Charge(id="ch_1", status="declined", decline_code="card_declined")],
        [Charge(id="ch_1", status="succeeded"), Transfer(id="tr_1", status="rejected", reject_reason="account_closed"),
         Refund(id="re_1", status="succeeded")],
    ],
    ids=["paid", "declined", "rejected-and-refunded"],
)
async def test_after_every_phase_the_payment_it_holds_is_the_payment_stored(engine, acme, outcomes):
    # Bug caught: a phase's statement that changes a column without
    # returning it (each returns only what it changed, and the engine applies
    # that to the payment it holds), or Handler1 building its payment with a
    # value other than the one the database stored or defaulted: the next
    # call, the stored response and the event would then be made from a
    # payment that is not the one in the table.
    async def stored(op):
        return await atomic(engine, payment_table.get, acme.id, op.subject.id)

    op = await new_operation(engine, acme, str(uuid.uuid4()))
    assert op.subject == await stored(op)
    record = {Charge: phases.record_charge, Transfer: phases.record_transfer, Refund: phases.record_refund}
    for outcome in outcomes:
        op = await one_statement(engine, record[type(outcome)], op, outcome, 30)
        assert op.subject == await stored(op), op.recovery_point
    assert op.recovery_point == "finished"


async def test_a_paid_payments_two_updates_are_hot_and_write_no_index_entry(engine, db, acme):
    # Bug caught: an index of `payment` naming a column that changes on the
    # way to `succeeded` (its status, as the reference's index once did in its
    # WHERE; the payout's instruction time; the end-to-end reference written
    # when the charge is recorded instead of with the payment): every update
    # of every payment would then write a new entry into each index
    # (migration 0014). One transaction, so the counts are this payment's
    # alone, whatever else the database is doing.
    #
    # An update is HOT only if its new version fits on the old one's page,
    # and this payment's three versions all stay until it commits. `clean`
    # empties the table by DELETE, which leaves earlier tests' rows on their
    # pages until a later read prunes them, and nothing prunes a row that a
    # transaction still open in this database might see. So the table is
    # truncated first: the payment is the first row on a new page, and the
    # count depends on the indexes alone.
    await db.execute("TRUNCATE payment CASCADE")
    key = str(uuid.uuid4())
    request = PaymentRequest.model_validate(payment_body())

    async def pay(conn):
        op = await phases.handler1(conn, PAYMENT, client_id=acme.id, key=key, request_hash=b"h", request=request,
                                   lease_seconds=30)
        op = await phases.record_charge(conn, op, Charge(id="ch_1", status="succeeded"), 30)
        op = await phases.record_transfer(conn, op, Transfer(id="tr_1", status="accepted"), 30)
        assert op.subject.status == "succeeded"
        counts = await conn.execute(text(
            "SELECT pg_stat_get_xact_tuples_updated(CAST('payment' AS regclass)) AS updated, "
            "pg_stat_get_xact_tuples_hot_updated(CAST('payment' AS regclass)) AS hot"
        ))
        return counts.one()

    updated, hot = await atomic(engine, pay)
    assert (updated, hot) == (2, 2)


async def test_a_declined_payment_gives_its_reference_up_and_shows_no_end_to_end_reference(engine, db, acme):
    # Bug caught: the end-to-end reference, written with the payment since
    # migration 0014, shown to a client whose card was declined (no payout
    # was ever instructed), or a declined payment still holding its reference.
    request = PaymentRequest.model_validate(payment_body())

    async def create(key: str):
        return await one_statement(engine, phases.handler1, PAYMENT, client_id=acme.id, key=key, request_hash=b"h",
                                   request=request, lease_seconds=30)

    op = await create(str(uuid.uuid4()))
    declined = await one_statement(
        engine, phases.record_charge, op, Charge(id="ch_1", status="declined", decline_code="card_declined"), 30
    )
    row = await db.fetchrow("SELECT holds_reference, end_to_end_reference, payout_instructed_at FROM payment")
    assert row["holds_reference"] is False and row["end_to_end_reference"] and row["payout_instructed_at"] is None
    assert declined.response is not None and json.loads(declined.response[1])["end_to_end_reference"] is None
    again = await create(str(uuid.uuid4()))  # the same order, paid again under a new key
    assert again is not None and again.subject.holds_reference


async def test_handler1_for_a_taken_reference_leaves_no_key_row(engine, db, acme):
    request = PaymentRequest.model_validate(payment_body())
    for key in (first := str(uuid.uuid4()), second := str(uuid.uuid4())):
        try:
            await one_statement(
                engine, phases.handler1, PAYMENT, client_id=acme.id, key=key, request_hash=b"h", request=request,
                lease_seconds=30,
            )
        except ProblemError as refused:
            assert key == second and refused.problem is DUPLICATE_PAYMENT

    # The claim was in the same statement as the refused insert: rolled back too.
    assert await db.fetchval("SELECT count(*) FROM idempotency_key WHERE key = $1", first) == 1
    assert await db.fetchval("SELECT count(*) FROM idempotency_key WHERE key = $1", second) == 0
    assert await db.fetchval("SELECT count(*) FROM payment") == 1


async def test_a_live_lease_cannot_be_taken_over_and_an_expired_one_can(engine, db, acme):
    key = str(uuid.uuid4())
    await new_operation(engine, acme, key)  # its owner holds a 30 s lease
    before = await snapshot(db, key)

    assert await atomic(engine, machine_engine.take_over_phase, BY_ENDPOINT, acme.id, key, 30) is None, "the owner is alive"
    assert await snapshot(db, key) == before

    await db.execute("UPDATE idempotency_key SET lease_expires_at = now() - interval '1 second' WHERE key = $1", key)
    taken = await atomic(engine, machine_engine.take_over_phase, BY_ENDPOINT, acme.id, key, 30)
    assert taken is not None and taken.attempt == 2 and taken.resumed


def statements_through_sqlalchemy(engine) -> list[str]:
    """Every statement SQLAlchemy itself sends on `engine` from now on (the driver path sends none)."""
    sent: list[str] = []
    event.listen(engine.sync_engine, "before_cursor_execute", lambda conn, cursor, sql, *rest: sent.append(sql))
    return sent


async def test_a_lone_statement_goes_to_the_driver_only_when_it_is_allowed(engine, db, acme):
    # Bug caught: the optimisation silently never applies (or applies with
    # REPLAY_SHORTCUT=false, which must switch every optimisation off).
    sent = statements_through_sqlalchemy(engine)
    await new_operation(engine, acme, str(uuid.uuid4()))
    on = engine.sync_engine.get_execution_options()[DRIVER_STATEMENTS]
    through_sqlalchemy = [sql for sql in sent if "claim_idempotency_key" in sql]
    assert through_sqlalchemy == ([] if on else [phases.HANDLER1.positional.sql])


async def test_a_statement_inside_a_transaction_is_sqlalchemys_and_rolls_back_with_it(engine, db, acme):
    # Bug caught: the driver path used inside `atomic` would run the claim
    # outside the transaction SQLAlchemy began, so it would commit on its own
    # and survive the rollback of the rest of the phase.
    key = str(uuid.uuid4())
    request = PaymentRequest.model_validate(payment_body())

    class Abandoned(Exception):
        pass

    async def claim_then_fail(conn):
        op = await phases.handler1(conn, PAYMENT, client_id=acme.id, key=key, request_hash=b"h", request=request,
                                   lease_seconds=30)
        assert op is not None
        raise Abandoned

    with pytest.raises(Abandoned):
        await atomic(engine, claim_then_fail)

    assert await db.fetchval("SELECT count(*) FROM idempotency_key WHERE key = $1", key) == 0
    assert await db.fetchval("SELECT count(*) FROM payment") == 0


async def test_a_phase_refused_as_read_only_is_an_outage_and_its_connection_is_not_used_again(database_url, db, acme):
    # What a standby, or a primary being demoted, answers a write (25006): the
    # phase is a lost database (a 503, a back-off), never a bug, and the pool
    # must not lend that connection for a write again. Bug caught: the
    # driver path raising the error without letting go of the connection.
    engine = create_async_engine(asyncpg_url(database_url), pool_size=1, max_overflow=0,
                                 execution_options={DRIVER_STATEMENTS: True})
    install_listeners(engine)
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SET SESSION default_transaction_read_only = on"))
            await conn.commit()
            pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        with pytest.raises(Exception) as refused:
            await new_operation(engine, acme, str(uuid.uuid4()))
        assert getattr(refused.value, "sqlstate", None) == "25006" and database_unavailable(refused.value)

        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one() != pid
        await new_operation(engine, acme, str(uuid.uuid4()))  # and the new connection writes
    finally:
        await engine.dispose()
    assert await db.fetchval("SELECT count(*) FROM payment") == 1
