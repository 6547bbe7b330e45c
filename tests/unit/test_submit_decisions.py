"""submit_payment's response matrix, one row per test, in milliseconds.

The response matrix (app/machine/matrix.py, reached through
app/payments/submission.py) decides from the stored key row alone what a POST
gets: a claim and a drive, a 422, a replay, a 202, a 409 or a takeover. The
real-process tests (tests/integration, tests/crash) prove each row against
PostgreSQL and the fake rails; these prove the decision itself, with the
database and the rails replaced by the in-memory fakes of tests/unit/fakes.py,
so that each row also says what it must *not* do (a 422 never takes over, a
replay never calls the PSP, a parked key drives nothing).

Each test names, in its docstring, the one-line bug in matrix.py it catches.
"""

from __future__ import annotations

import pytest

from app.payments import submission
from app.payments.recovery_points import EXT1_SENT, EXT2_SENT, FINISHED
from app.machine.engine import Finished, Pending
from app.machine.matrix import Reply
from app.problems import IDEMPOTENCY_KEY_REUSED, REQUEST_IN_PROGRESS, ProblemError
from app.rails.answers import Charge, Transfer
from app.rails.outcomes import Applied
from tests.unit import fakes
from tests.unit.fakes import CLIENT, KEY, REQUEST, FakeSystem

SUCCEEDED = Applied(Charge(id="ch_1", status="succeeded"))
ACCEPTED = Applied(Transfer(id="tr_1", status="accepted"))


@pytest.fixture
def db(monkeypatch):
    return fakes.install(monkeypatch)


def submit(services, row):
    return submission.submit_payment(services, CLIENT, KEY, REQUEST, row=row)


def assert_in_progress(exc_info) -> None:
    """A 409 request-in-progress telling the client when to retry (settings.retry_after_seconds is 7)."""
    assert exc_info.value.problem is REQUEST_IN_PROGRESS
    assert exc_info.value.problem.status == 409
    assert exc_info.value.headers == {"Retry-After": "7"}


async def test_a_new_key_is_claimed_then_driven_to_its_final_response(db):
    """Bug caught: returning after handler1 without driving (or probing a fresh claim before charging)."""
    psp = FakeSystem("psp", charge=[SUCCEEDED])
    rail = FakeSystem("rail", transfer=[ACCEPTED])

    reply = await submit(fakes.services(psp, rail), row=None)

    row = db.row()
    assert reply == Reply(Finished(201, row.response_body), replayed=False)
    assert db.names == ["handler1", "record_charge", "record_transfer"]
    # A fresh claim sent nothing before, so it charges at once, without probing.
    assert psp.names == ["charge"] and rail.names == ["transfer"]


@pytest.mark.parametrize(
    "stored",
    [
        dict(recovery_point=EXT1_SENT),  # started, lease expired: would otherwise be taken over
        dict(recovery_point=FINISHED),  # finished: would otherwise be replayed
        dict(recovery_point=EXT2_SENT, parked=True),  # parked: would otherwise answer 202
    ],
    ids=["expired", "finished", "parked"],
)
async def test_a_key_first_used_for_a_different_body_is_refused_422_before_anything_else(db, stored):
    """Bug caught: `row.request_hash != request_hash` dropped from the 422 check, so another body is taken over, 409'd or 202'd."""
    row = db.seed(request_hash=b"another request's fingerprint", **stored)
    psp, rail = FakeSystem("psp"), FakeSystem("rail")

    with pytest.raises(ProblemError) as exc_info:
        await submit(fakes.services(psp, rail), row=row)

    assert exc_info.value.problem is IDEMPOTENCY_KEY_REUSED
    assert exc_info.value.problem.status == 422
    assert db.calls == []  # no take_over, no read, no write
    assert psp.calls == [] and rail.calls == []


async def test_a_key_first_used_on_another_endpoint_is_refused_422(db):
    """Bug caught: comparing only the request hash and forgetting the endpoint it was stored for."""
    db.seed(FINISHED)
    db.keys[(CLIENT, KEY)].endpoint = "POST /v1/refunds"

    with pytest.raises(ProblemError) as exc_info:
        await submit(fakes.services(), row=db.row())

    assert exc_info.value.problem is IDEMPOTENCY_KEY_REUSED
    assert db.calls == []


async def test_a_finished_key_replays_its_stored_response_and_calls_nothing(db):
    """Bug caught: `replayed=False` on a replay, or a finished row falling through to a takeover or a drive."""
    row = db.seed(FINISHED, status="succeeded")
    psp, rail = FakeSystem("psp"), FakeSystem("rail")

    reply = await submit(fakes.services(psp, rail), row=row)

    assert reply == Reply(Finished(201, row.response_body), replayed=True)
    assert db.calls == []
    assert psp.calls == [] and rail.calls == []


@pytest.mark.parametrize("last_error, reason", [("rail: timed out", "rail: timed out"), (None, "parked")])
async def test_a_parked_key_answers_pending_and_drives_nothing(db, last_error, reason):
    """Bug caught: the parked check placed after the lease check, so a parked row is taken over and resumed blindly."""
    row = db.seed(EXT2_SENT, parked=True, status="indeterminate", last_error=last_error)
    psp, rail = FakeSystem("psp"), FakeSystem("rail")

    reply = await submit(fakes.services(psp, rail), row=row)

    payment = db.payments[row.payment_id]
    assert reply == Reply(Pending(payment, reason), replayed=False)
    assert payment.status == "indeterminate"  # a 202 saying so, never "failed"
    assert db.names == ["load payment"]  # a read, and nothing written
    assert psp.calls == [] and rail.calls == []


async def test_a_started_key_with_a_live_lease_is_409_with_retry_after(db):
    """Bug caught: the live-lease check dropped, so a retry tries to take over from a live owner."""
    row = db.seed(EXT1_SENT, lease_live=True)
    psp = FakeSystem("psp")

    with pytest.raises(ProblemError) as exc_info:
        await submit(fakes.services(psp), row=row)

    assert_in_progress(exc_info)
    assert db.calls == []  # not even an attempt to take over
    assert psp.calls == []


async def test_an_expired_lease_is_taken_over_and_driven_probing_before_sending(db):
    """Bug caught: the takeover's operation not driven, or driven as a fresh claim (charging without probing)."""
    row = db.seed(EXT1_SENT, lease_live=False)
    psp = FakeSystem("psp", find_charge=[SUCCEEDED])  # the dead owner's charge went through
    rail = FakeSystem("rail", transfer=[ACCEPTED])

    reply = await submit(fakes.services(psp, rail), row=row)

    assert reply == Reply(Finished(201, db.row().response_body))
    assert db.names == ["take_over", "record_charge", "record_transfer"]
    assert psp.names == ["find_charge"]  # found, so never charged twice


async def test_a_takeover_lost_to_another_retry_is_409(db):
    """Bug caught: `if op is None` dropped after take_over, so the loser drives nothing (None) or crashes with a 500."""
    row = db.seed(EXT1_SENT, lease_live=False)  # what this request read: expired
    db.steal()  # meanwhile another retry took it over
    psp = FakeSystem("psp")

    with pytest.raises(ProblemError) as exc_info:
        await submit(fakes.services(psp), row=row)

    assert_in_progress(exc_info)
    assert db.names == ["take_over"]
    assert psp.calls == []


@pytest.mark.parametrize(
    "theirs, expected",
    [
        (dict(lease_live=True), "409"),  # the other first attempt is still running
        (dict(recovery_point=FINISHED), "replay"),  # and has already finished
        (dict(request_hash=b"their body"), "422"),  # with another body under the same key
    ],
    ids=["live", "finished", "other-body"],
)
async def test_a_concurrent_first_attempt_makes_handler1_return_none_and_the_stored_row_decides(db, theirs, expected):
    """Bug caught: after handler1 returns None, answering 409 without reading the row (or deciding from the stale None)."""
    db.seed(**theirs)  # stored by the other attempt after this one read nothing
    psp = FakeSystem("psp")

    if expected == "replay":
        reply = await submit(fakes.services(psp), row=None)
        assert reply == Reply(Finished(201, db.row().response_body), replayed=True)
    else:
        with pytest.raises(ProblemError) as exc_info:
            await submit(fakes.services(psp), row=None)
        if expected == "409":
            assert_in_progress(exc_info)
        else:
            assert exc_info.value.problem is IDEMPOTENCY_KEY_REUSED
    assert db.names == ["handler1", "key_table.load"]
    assert psp.calls == []


async def test_a_claimed_row_that_vanished_before_the_re_read_is_409(db):
    """Bug caught: `if row is None` dropped after the re-read, so a reaped row crashes with a 500 (or is claimed again)."""
    db.seed(EXT1_SENT, lease_live=True)
    db.after["handler1"] = db.keys.clear  # reaped between handler1 and the re-read

    with pytest.raises(ProblemError) as exc_info:
        await submit(fakes.services(), row=None)

    assert_in_progress(exc_info)
    assert db.names == ["handler1", "key_table.load"]


async def test_a_lease_lost_while_driving_is_409_and_writes_nothing_more(db):
    """Bug caught: `_drive` not turning LeaseLost into a 409 (a 500 reaches the client instead)."""

    def charged_while_a_retry_took_over():
        db.steal()  # this attempt stalled at the PSP past its lease
        return SUCCEEDED

    psp = FakeSystem("psp", charge=[charged_while_a_retry_took_over])

    with pytest.raises(ProblemError) as exc_info:
        await submit(fakes.services(psp), row=None)

    assert_in_progress(exc_info)
    # The fence stopped record_charge; the new owner will probe, find the
    # charge and answer the client. This attempt releases nothing (not its own).
    assert db.names == ["handler1", "record_charge"]
    assert db.row().recovery_point == EXT1_SENT

