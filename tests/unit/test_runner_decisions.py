"""The engine's decisions, in milliseconds: when to probe, when to send, when to release or park, how long to wait.

app/machine/engine.py moves every operation forward; these drive the
payment's machine (app/payments/payment.py). The real-process tests
(tests/crash, tests/integration) prove it end to end against PostgreSQL and
the fake rails, killing processes between phases; these prove each decision
on its own, with the database and the rails replaced by the in-memory fakes
of tests/unit/fakes.py:

    _call        a repeatable step: a resumed owner probes before it sends;
                 an unknown send gets one inline probe
    _call_once   a legacy payout: a resumed owner never sends
    _give_up     release with backoff (and not_sent), or park
    drive        exceptions count as unknown, LeaseLost and cancellation do not
    backoff_seconds, heal

Each test names, in its docstring, the one-line bug in engine.py it catches.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from app.idempotency.key_table import LeaseLost
from app.machine import engine
from app.payments.machines import BY_ENDPOINT
from app.payments.payment import PAYMENT
from app.payments.recovery_points import EXT1_SENT, EXT2_SENT, EXT3_SENT
from app.machine.engine import Finished, Pending
from app.rails.answers import Charge, Transfer
from app.rails.outcomes import Applied, NotApplied, NotFound, Settling, Unknown
from tests.unit import fakes
from tests.unit.fakes import CLIENT, KEY, LEGACY_IBAN, FakeSystem

SUCCEEDED = Applied(Charge(id="ch_1", status="succeeded"))
ACCEPTED = Applied(Transfer(id="tr_1", status="accepted"))
TIMED_OUT = Unknown("psp: timed out")
REFUSED = NotApplied("psp: connection refused")
SETTLING = Settling("psp: pending")
CHARGE = PAYMENT.calls[EXT1_SENT]


@pytest.fixture
def db(monkeypatch):
    return fakes.install(monkeypatch)


# -- _call: a step whose external system deduplicates and answers probes ----


async def test_a_fresh_owner_sends_without_probing(db):
    """Bug caught: `if not op.resumed` in _call, probing every fresh intent (or never probing a resumed one)."""
    op = db.owned(resumed=False)
    psp = FakeSystem("psp", charge=[SUCCEEDED])

    assert await engine._call(fakes.services(psp), CHARGE, op) == SUCCEEDED
    assert psp.names == ["charge"]


@pytest.mark.parametrize("found", [SUCCEEDED, Unknown("psp: 503")], ids=["applied", "unknown"])
async def test_a_resumed_owner_whose_probe_answers_applied_or_unknown_does_not_send(db, found):
    """Bug caught: `isinstance(found, Applied)` alone, so an unknown probe is followed by a blind send."""
    op = db.owned(resumed=True)
    psp = FakeSystem("psp", find_charge=[found])

    assert await engine._call(fakes.services(psp), CHARGE, op) == found
    assert psp.names == ["find_charge"]


async def test_a_resumed_owner_whose_probe_finds_nothing_sends_the_same_payment_with_the_same_key(db):
    """Bug caught: returning the NotFound instead of sending, so a charge never made is never made."""
    op = db.owned(resumed=True)
    psp = FakeSystem("psp", find_charge=[NotFound()], charge=[SUCCEEDED])

    assert await engine._call(fakes.services(psp), CHARGE, op) == SUCCEEDED
    assert psp.names == ["find_charge", "charge"]
    assert psp.calls[1].args == (op.subject.psp_charge_key, op.subject)


async def test_an_unknown_send_gets_exactly_one_inline_probe_whose_applied_answer_is_used(db):
    """Bug caught: returning `sent` after the inline probe, so an applied charge waits for the next actor."""
    op = db.owned(resumed=False)
    psp = FakeSystem("psp", charge=[TIMED_OUT], find_charge=[SUCCEEDED])

    assert await engine._call(fakes.services(psp), CHARGE, op) == SUCCEEDED
    assert psp.names == ["charge", "find_charge"]


@pytest.mark.parametrize("found", [NotFound(), Unknown("psp: 503")], ids=["not-found", "unknown"])
async def test_an_unknown_send_whose_probe_learns_nothing_stays_unknown(db, found):
    """Bug caught: `return found` after the inline probe, so a NotFound (maybe just not visible yet) leaks out as the outcome."""
    op = db.owned(resumed=False)
    psp = FakeSystem("psp", charge=[TIMED_OUT], find_charge=[found])

    assert await engine._call(fakes.services(psp), CHARGE, op) == TIMED_OUT
    assert psp.names == ["charge", "find_charge"]  # one probe, never a second send


async def test_a_send_not_applied_is_returned_without_a_probe(db):
    """Bug caught: `isinstance(sent, (Unknown, NotApplied))`, probing after a refusal that certainly sent nothing."""
    op = db.owned(resumed=False)
    psp = FakeSystem("psp", charge=[REFUSED])

    assert await engine._call(fakes.services(psp), CHARGE, op) == REFUSED
    assert psp.names == ["charge"]


@pytest.mark.parametrize(
    "point, system, send, probe, send_key, probe_key",
    [
        (EXT1_SENT, "psp", "charge", "find_charge", "psp_charge_key", "psp_charge_key"),
        (EXT2_SENT, "rail", "transfer", "find_transfer", "rail_transfer_key", "end_to_end_reference"),
        (EXT3_SENT, "psp", "refund", "find_refund", "psp_refund_key", "psp_refund_key"),
    ],
)
async def test_each_step_sends_with_its_derived_key_and_probes_by_its_own_identifier(
    db, point, system, send, probe, send_key, probe_key
):
    """Bug caught: a step wired to another call or key in _STEPS (the rail probed by K2 instead of the end-to-end reference)."""
    op = db.owned(point, resumed=True)
    fake = FakeSystem(system, **{probe: [NotFound()], send: [Unknown("timed out")]})
    fake.scripts[probe].append(NotFound())  # the inline probe after the unknown send
    services = fakes.services(**{system: fake})

    await engine._call(services, PAYMENT.calls[point], op)

    assert fake.names == [probe, send, probe]
    assert fake.calls[0].args == (getattr(op.subject, probe_key),)
    assert fake.calls[1].args == (getattr(op.subject, send_key), op.subject)
    assert getattr(op.subject, send_key) is not None


# -- _call_once: a payout to a legacy rail, which cannot be probed or deduplicate --


async def test_a_resumed_owner_of_a_legacy_payout_answers_unknown_without_sending(db):
    """Bug caught: `if not op.resumed` in _call_once, sending a payout the dead owner may already have sent."""
    op = db.owned(EXT2_SENT, resumed=True, iban=LEGACY_IBAN)
    rail = FakeSystem("rail")

    outcome = await engine._call_once(fakes.services(rail=rail), PAYMENT.calls[EXT2_SENT], op)

    assert isinstance(outcome, Unknown)
    assert rail.calls == []


async def test_a_fresh_owner_of_a_legacy_payout_sends_once_and_never_probes(db):
    """Bug caught: the `op.resumed` check inverted or dropped, so a fresh legacy payout is never sent and only ever parks."""
    op = db.owned(EXT2_SENT, resumed=False, iban=LEGACY_IBAN)
    rail = FakeSystem("rail", transfer=[Unknown("rail: timed out")])

    outcome = await engine._call_once(fakes.services(rail=rail), PAYMENT.calls[EXT2_SENT], op)

    assert outcome == Unknown("rail: timed out")
    assert rail.names == ["transfer"]


# -- Settling: a provider that holds the request and decides it later -------


async def test_a_resumed_owner_whose_probe_says_settling_waits_and_never_sends_again(db):
    """Bug caught: Settling missing from `isinstance(found, (Applied, Unknown, Settling))` in _call: a second send."""
    op = db.owned(resumed=True)
    psp = FakeSystem("psp", find_charge=[SETTLING])

    assert await engine._call(fakes.services(psp), CHARGE, op) == SETTLING
    assert psp.names == ["find_charge"]


async def test_a_send_answered_settling_is_released_with_backoff_and_polled_later(db):
    """Bug caught: Settling treated as applied or final, finishing (or parking) a call the provider has not decided."""
    op = db.owned(resumed=False, attempt=1)
    psp = FakeSystem("psp", charge=[SETTLING])

    result = await engine.drive(fakes.services(psp), op)

    assert result == Pending(op.subject, "psp: pending")
    assert psp.names == ["charge"]  # no inline probe: the provider just said it has the request
    assert db.names == ["release"]
    assert db.calls[0].kwargs == {"not_sent": False}  # the next owner probes, never sends blind
    assert not db.row().parked


async def test_a_call_still_settling_at_the_last_attempt_is_parked_for_reconciliation(db):
    """Bug caught: polling with no bound: a provider that never settles would be asked forever."""
    op = db.owned(resumed=True, attempt=3)  # max_attempts is 3
    psp = FakeSystem("psp", find_charge=[SETTLING])

    result = await engine.drive(fakes.services(psp), op)

    assert isinstance(result, Pending) and result.reason == "psp: pending"
    assert db.names == ["park"] and db.row().parked


async def test_heal_whose_probe_is_still_settling_writes_nothing_more(db):
    """Bug caught: Settling counted as an answer by heal, unparking and driving a call nobody has decided."""
    db.seed(EXT1_SENT, parked=True, attempts=3)
    psp = FakeSystem("psp", find_charge=[SETTLING])

    assert await engine.heal(fakes.services(psp), BY_ENDPOINT, CLIENT, KEY) is None
    assert db.names == ["key_table.claim_recheck", "key_table.load", "load payment"]
    assert db.row().parked and db.row().attempts == 3


# -- _give_up: release for later, or park ----------------------------------


async def test_an_unknown_outcome_below_max_attempts_is_released_with_backoff(db):
    """Bug caught: `not_sent = isinstance(outcome, Unknown)`, letting the next owner send without probing."""
    op = db.owned(resumed=False, attempt=2)  # max_attempts is 3

    pending = await engine._give_up(fakes.services(), op, TIMED_OUT, final=False)

    assert pending == Pending(op.subject, "psp: timed out")
    assert db.names == ["release"]
    (release,) = db.calls
    _, reason, retry_in = release.args
    assert reason == "psp: timed out"
    assert 1.0 <= retry_in <= 2.0  # attempt 2, base 1: a ceiling of 2 s, jittered down to half
    assert release.kwargs == {"not_sent": False}
    assert not db.row().lease_live and not db.row().parked


async def test_a_not_applied_outcome_is_released_saying_not_sent(db):
    """Bug caught: not_sent not passed to release, so the next owner probes a call that was never made (or, legacy, never sends)."""
    op = db.owned(resumed=False, attempt=1)

    await engine._give_up(fakes.services(), op, REFUSED, final=False)

    assert db.names == ["release"]
    assert db.calls[0].kwargs == {"not_sent": True}
    assert db.keys[(CLIENT, KEY)].not_sent


async def test_an_unknown_outcome_at_max_attempts_is_parked(db):
    """Bug caught: `op.attempt > settings.max_attempts`, retrying once more than allowed."""
    op = db.owned(resumed=True, attempt=3)  # max_attempts is 3

    pending = await engine._give_up(fakes.services(), op, TIMED_OUT, final=False)

    assert db.names == ["park"]
    assert db.calls[0].args[1:] == ("psp: timed out", 300.0)  # re-probed after parked_recheck_seconds
    assert db.calls[0].kwargs == {"not_sent": False}
    assert pending.subject.status == "indeterminate" and pending.reason == "psp: timed out"
    assert db.row().parked


async def test_a_final_outcome_parks_at_once(db):
    """Bug caught: `final` ignored, so a legacy payout whose outcome is unknown is retried (and could be sent twice)."""
    op = db.owned(EXT2_SENT, resumed=False, attempt=1, iban=LEGACY_IBAN)

    pending = await engine._give_up(fakes.services(), op, Unknown("rail: timed out"), final=True)

    assert db.names == ["park"]
    assert pending.subject.status == "indeterminate"


async def test_a_not_applied_outcome_on_the_last_attempt_is_parked_saying_not_sent(db):
    """Bug caught: not_sent dropped from the park, so reconciliation or a re-probe treats a payout never sent as maybe sent."""
    op = db.owned(resumed=True, attempt=3)

    await engine._give_up(fakes.services(), op, REFUSED, final=False)

    assert db.names == ["park"]
    assert db.calls[0].kwargs == {"not_sent": True}


# -- drive: what leaves a step, and how ------------------------------------


async def test_an_exception_in_a_step_counts_as_unknown_released_with_backoff(db):
    """Bug caught: the `except Exception` branch re-raising, so a bug mid-payment is a 500 and the lease just hangs."""
    op = db.owned(resumed=False, attempt=1)
    psp = FakeSystem("psp", charge=[RuntimeError("boom: secret detail")])

    result = await engine.drive(fakes.services(psp), op)

    assert result == Pending(op.subject, "interrupted by RuntimeError")  # a classified phrase, never the text
    assert db.names == ["release"]
    _, reason, retry_in = db.calls[0].args
    assert reason == "interrupted by RuntimeError"
    assert 0.5 <= retry_in <= 1.0
    # The call may have been made before the exception: the next owner must probe.
    assert db.calls[0].kwargs == {"not_sent": False}


async def test_a_lost_lease_propagates_and_nothing_is_released(db):
    """Bug caught: `except LeaseLost: raise` removed, so a fenced-off attempt tries to release the new owner's operation."""
    op = db.owned(resumed=False)

    def charged_while_a_retry_took_over():
        db.steal()
        return SUCCEEDED

    psp = FakeSystem("psp", charge=[charged_while_a_retry_took_over])

    with pytest.raises(LeaseLost):
        await engine.drive(fakes.services(psp), op)
    assert db.names == ["record_charge"]


async def test_a_cancelled_drive_releases_at_once_then_re_raises(db):
    """Bug caught: the shielded `_release_now` dropped, so a shutdown leaves the lease to run out (30 s) before anyone resumes."""
    op = db.owned(resumed=False)
    psp = FakeSystem("psp", charge=[asyncio.CancelledError()])

    with pytest.raises(asyncio.CancelledError):
        await engine.drive(fakes.services(psp), op)

    assert db.names == ["release"]
    assert db.calls[0].args[1:] == ("interrupted: stopping", 0.0)  # due again at once
    assert db.calls[0].kwargs == {"event": "stopping, released"}
    assert not db.row().lease_live


async def test_an_unknown_outcome_on_a_legacy_step_parks_at_once(db):
    """Bug caught: `final` computed without `not repeatable`, so an unknown legacy payout is released and retried."""
    op = db.owned(EXT2_SENT, resumed=False, attempt=1, iban=LEGACY_IBAN)
    rail = FakeSystem("rail", transfer=[Unknown("rail: timed out")])

    result = await engine.drive(fakes.services(rail=rail), op)

    assert isinstance(result, Pending) and result.subject.status == "indeterminate"
    assert db.names == ["park"]
    assert rail.names == ["transfer"]


async def test_a_not_applied_outcome_on_a_legacy_step_is_released_not_parked(db):
    """Bug caught: `final = not repeatable`, parking a payout that certainly was not sent and is safe to send later."""
    op = db.owned(EXT2_SENT, resumed=False, attempt=1, iban=LEGACY_IBAN)
    rail = FakeSystem("rail", transfer=[NotApplied("rail: connection refused")])

    result = await engine.drive(fakes.services(rail=rail), op)

    assert result == Pending(op.subject, "rail: connection refused")
    assert db.names == ["release"]
    assert db.calls[0].kwargs == {"not_sent": True}


# -- backoff_seconds -------------------------------------------------------


@pytest.mark.parametrize("attempt", range(1, 13))
def test_backoff_stays_between_half_the_ceiling_and_the_ceiling(monkeypatch, attempt):
    """Bug caught: `2 ** attempt` (twice too long) or `random.uniform(0, ceiling)` (jitter down to zero)."""
    ceiling = min(300.0, 1.0 * 2 ** (attempt - 1))
    # The extremes of the jitter, exactly, then real draws.
    monkeypatch.setattr(engine, "random", SimpleNamespace(uniform=lambda low, high: low))
    assert engine.backoff_seconds(attempt, 1.0, 300.0) == ceiling / 2
    monkeypatch.setattr(engine, "random", SimpleNamespace(uniform=lambda low, high: high))
    assert engine.backoff_seconds(attempt, 1.0, 300.0) == ceiling
    monkeypatch.undo()
    for _ in range(20):
        assert ceiling / 2 <= engine.backoff_seconds(attempt, 1.0, 300.0) <= ceiling


def test_backoff_never_exceeds_the_cap():
    """Bug caught: the `min(cap, ...)` dropped, so attempt 30 waits for years."""
    for attempt in (10, 11, 20, 50):  # 2^9 = 512 > 300 from attempt 10 on
        assert 150.0 <= engine.backoff_seconds(attempt, 1.0, 300.0) <= 300.0


def test_backoff_jitter_actually_varies():
    """Bug caught: a constant instead of `random.uniform`, so operations failed in one outage retry in the same instant."""
    assert len({engine.backoff_seconds(5, 1.0, 300.0) for _ in range(50)}) > 1


# -- heal: the worker's re-probe of a parked operation ---------------------


async def test_heal_probes_nothing_when_the_recheck_is_not_ours(db):
    """Bug caught: `if claimed is None` dropped, so every worker probes every parked operation at once (or crashes)."""
    db.seed(EXT1_SENT, parked=False)  # not parked (or not due): claim_recheck returns None
    psp = FakeSystem("psp")

    assert await engine.heal(fakes.services(psp), BY_ENDPOINT, CLIENT, KEY) is None
    assert db.names == ["key_table.claim_recheck"]
    assert psp.calls == []


async def test_heal_leaves_a_legacy_payout_to_reconciliation_unprobed(db):
    """Bug caught: `not step.repeatable(...)` dropped, probing (then re-sending) a payout to a rail that cannot deduplicate."""
    db.seed(EXT2_SENT, parked=True, iban=LEGACY_IBAN)
    rail = FakeSystem("rail")

    assert await engine.heal(fakes.services(rail=rail), BY_ENDPOINT, CLIENT, KEY) is None
    assert db.names == ["key_table.claim_recheck", "key_table.load", "load payment"]
    assert rail.calls == []
    assert db.row().parked


async def test_heal_whose_probe_is_still_unknown_writes_nothing_more(db):
    """Bug caught: unparking before the probe (or on Unknown), so every fruitless re-probe costs an attempt and drives blind."""
    db.seed(EXT1_SENT, parked=True, attempts=3)
    psp = FakeSystem("psp", find_charge=[Unknown("psp: 503")])

    assert await engine.heal(fakes.services(psp), BY_ENDPOINT, CLIENT, KEY) is None
    assert db.names == ["key_table.claim_recheck", "key_table.load", "load payment"]  # the claim, a read, and nothing written after
    assert psp.names == ["find_charge"]
    row = db.row()
    assert row.parked and row.attempts == 3


@pytest.mark.parametrize(
    "found, psp_script, psp_calls",
    [
        # Not found: unparked and driven like any resumer: probe, then charge with K1.
        (NotFound(), dict(find_charge=[NotFound(), NotFound()], charge=[SUCCEEDED]), ["find_charge", "find_charge", "charge"]),
        # Applied: unparked and driven: the resumer's probe finds it, nothing is sent.
        (SUCCEEDED, dict(find_charge=[SUCCEEDED, SUCCEEDED]), ["find_charge", "find_charge"]),
    ],
    ids=["not-found", "applied"],
)
async def test_heal_whose_probe_answers_unparks_then_drives(db, found, psp_script, psp_calls):
    """Bug caught: `isinstance(probe, Applied)` alone, so a charge the PSP never received stays parked for ever."""
    db.seed(EXT1_SENT, parked=True, attempts=3, status="indeterminate")
    psp = FakeSystem("psp", **psp_script)
    rail = FakeSystem("rail", transfer=[ACCEPTED])

    result = await engine.heal(fakes.services(psp, rail), BY_ENDPOINT, CLIENT, KEY)

    assert result == Finished(201, db.row().response_body)
    assert db.names == ["key_table.claim_recheck", "key_table.load", "load payment", "unpark", "record_charge", "record_transfer"]
    assert psp.names == psp_calls
    assert db.payments[db.row().payment_id].status == "succeeded"


async def test_heal_that_loses_the_unpark_to_another_actor_drives_nothing(db):
    """Bug caught: `if op is None` dropped after unpark, driving an operation someone else took back (a crash on None)."""
    db.seed(EXT1_SENT, parked=True)

    def answered_while_reconciliation_took_it_back():
        db.keys[(CLIENT, KEY)].parked = False
        return SUCCEEDED

    psp = FakeSystem("psp", find_charge=[answered_while_reconciliation_took_it_back])

    assert await engine.heal(fakes.services(psp), BY_ENDPOINT, CLIENT, KEY) is None
    assert db.names == ["key_table.claim_recheck", "key_table.load", "load payment", "unpark"]
    assert psp.names == ["find_charge"]
