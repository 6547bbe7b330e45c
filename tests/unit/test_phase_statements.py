"""Every phase's statement hangs off its fence: a stale owner's statement writes nothing at all.

app/machine/statements.py builds each single-statement phase from one fence,
the phase's own writes and, when it finishes, one outbox fragment. The
fence is what makes a statement safe to run by an owner whose lease was
taken over: it returns no row, and every write reads from it, so nothing is
written. These tests check that property of every statement the payment's
and the return refund's phases run, and that the fragments are the
canonical ones. The real-process tests prove the same from outside
(tests/integration/test_phases.py, the `fence` mutant).
"""

from __future__ import annotations

import pytest

from app.idempotency import key_table
from app.machine.statements import Statement, reads_of
from app.outbox import events
from app.payments import phases, returns
from app.payments.refunds import phases as refund_phases

STATEMENTS = {
    f"{module.__name__}.{name}": value
    for module in (phases, returns, refund_phases)
    for name, value in vars(module).items()
    if isinstance(value, Statement)
}
FENCES = {"claim": key_table.CLAIM_SQL, "advance": key_table.ADVANCE_SQL, "finish": key_table.FINISH_SQL}


def test_every_phase_of_every_operation_is_a_statement_built_here():
    assert set(STATEMENTS) == {
        "app.payments.phases.HANDLER1", "app.payments.phases.CHARGE_CAPTURED", "app.payments.phases.CHARGE_DECLINED",
        "app.payments.phases.PAYOUT_SENT", "app.payments.phases.PAYOUT_REJECTED",
        "app.payments.phases.CHARGE_REFUNDED",
        "app.payments.refunds.phases.CLAIM_REFUND", "app.payments.refunds.phases.REFUSED",
        "app.payments.refunds.phases.REFUND_SUCCEEDED", "app.payments.refunds.phases.REFUND_FAILED",
    }


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_each_statement_begins_with_its_fence_and_the_fence_names_the_lease_or_claims(name):
    statement = STATEMENTS[name]
    (first, body), *_ = statement.ctes
    assert first == "fence" and body == FENCES[statement.fence]
    assert statement.sql.startswith("WITH fence AS (")
    if statement.fence == "claim":
        assert "claim_idempotency_key(" in body
    else:
        assert "lease_token = :token AND state = 'started'" in body


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_every_business_write_reads_from_the_fence_or_from_a_write_that_does(name):
    seen = {"fence"}
    for cte, body in STATEMENTS[name].ctes[1:]:
        assert reads_of(body) & seen, f"{cte} reads only {sorted(reads_of(body))}: it would write without the fence"
        seen.add(cte)


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_a_statement_emits_its_event_exactly_when_it_finishes(name):
    statement = STATEMENTS[name]
    names = [cte for cte, _ in statement.ctes]
    if statement.fence == "finish" and statement.emits:
        assert names[-1] == "emitted"
        assert "FROM fence" in dict(statement.ctes)["emitted"], "no fence row, no event"
        assert "INSERT INTO event" in events.EMIT_SQL and "emitted AS (" in events.EMIT_SQL
    else:
        assert "emitted" not in names and "INSERT INTO event" not in statement.sql


def test_a_write_that_does_not_hang_off_the_fence_is_caught():
    """The check above is not vacuous: a payment UPDATE by id alone would write under a lost lease."""
    from app.machine.statements import advance

    loose = advance(updated="UPDATE payment SET status = 'x' WHERE id = :id RETURNING payment.*")
    (_, body), = loose.writes
    assert not (reads_of(body) & {"fence"})
