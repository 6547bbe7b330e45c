"""The console's timeline diagram is drawn from durable facts: each call between commits, and how it ended."""

from __future__ import annotations

from app.console.timeline import layout

PAYMENT = {
    "psp_charge_key": "k1" * 32, "psp_charge_id": "ch_1", "rail_transfer_key": "k2" * 32, "rail_transfer_id": "tr_1",
    "end_to_end_reference": "E2E1", "psp_refund_key": None, "psp_refund_id": None,
    "decline_code": None, "reject_reason": None,
}


def entry(event: str, point: str, attempt: int, second: int) -> dict:
    return {"at": f"2026-12-01T10:00:{second:02d}+00:00", "event": event, "recovery_point": point, "attempt": attempt}


def test_a_crash_then_a_takeover_is_drawn_as_a_cut_call_a_takeover_band_and_a_resumed_call():
    timeline = [
        entry("claimed", "EXT1_SENT", 1, 0),
        entry("taken over", "EXT1_SENT", 2, 3),
        entry("charge succeeded", "EXT2_SENT", 2, 4),
        entry("transfer accepted", "finished", 2, 5),
    ]

    d = layout(timeline, PAYMENT, finished=True, lease_live=False)

    assert [(e.event, e.kind, e.attempt) for e in d.events] == [
        ("claimed", "commit", 1), ("taken over", "takeover", 2),
        ("charge succeeded", "commit", 2), ("transfer accepted", "commit", 2),
    ]
    assert [(c.system, c.result, c.resumed) for c in d.calls] == [("psp", "cut", False), ("psp", "applied", True), ("rail", "applied", False)]
    assert d.calls[1].outcome == "succeeded · ch_1" and d.calls[1].key.startswith("K1 k1k1")
    assert d.calls[2].outcome == "accepted · tr_1" and d.calls[2].key.startswith("K2 k2k2")
    assert [b.text for b in d.bands] == ["attempt 2 takes over from attempt 1 (its lease had run out)"]
    assert [e.offset for e in d.events] == ["+0.000 s", "+3.000 s", "+4.000 s", "+5.000 s"]
    ys = sorted([e.y for e in d.events] + [c.y for c in d.calls] + [b.y for b in d.bands])
    assert len(set(ys)) == len(ys) and d.height > ys[-1], "no two rows overlap, and all fit"


def test_an_unknown_outcome_is_a_release_and_nothing_is_called_while_parked():
    timeline = [
        entry("claimed", "EXT1_SENT", 1, 0),
        entry("outcome unknown, released", "EXT1_SENT", 1, 1),
        entry("taken over", "EXT1_SENT", 2, 2),
        entry("parked", "EXT1_SENT", 2, 3),
    ]

    d = layout(timeline, PAYMENT, finished=False, lease_live=False)

    assert [(c.result, c.outcome) for c in d.calls] == [
        ("unknown", "no applied answer: released, retried later"),
        ("unknown", "no applied answer: parked"),
    ]
    assert d.events[-1].kind == "park"


def test_a_payout_settled_by_reconciliation_was_learned_from_the_statement_not_called():
    timeline = [
        entry("claimed", "EXT1_SENT", 1, 0),
        entry("charge succeeded", "EXT2_SENT", 1, 1),
        entry("parked", "EXT2_SENT", 1, 2),
        entry("settled by reconciliation", "EXT2_SENT", 2, 9),
        entry("transfer accepted", "finished", 2, 9),
    ]

    d = layout(timeline, PAYMENT, finished=True, lease_live=False)

    assert [(c.system, c.result) for c in d.calls] == [("psp", "applied"), ("rail", "unknown")]
    assert [b.text for b in d.bands] == ["attempt 2 takes over: settled by reconciliation"]


def test_the_last_call_of_an_unfinished_operation_is_in_flight_or_waiting():
    timeline = [entry("claimed", "EXT1_SENT", 1, 0)]

    assert layout(timeline, PAYMENT, finished=False, lease_live=True).calls[0].outcome == "in flight (lease live)"
    assert layout(timeline, PAYMENT, finished=False, lease_live=False).calls[0].result == "pending"


def test_the_read_model_names_the_payment_endpoint_the_service_claims_under():
    from app.payments.payment import PAYMENT as MACHINE
    from app.readmodel.queries import PAYMENT_ENDPOINT

    assert PAYMENT_ENDPOINT == MACHINE.endpoint


def test_a_client_refund_is_drawn_from_its_refund_row_with_k5_and_the_psps_failure_code():
    refund = {"psp_refund_key": "k5" * 32, "psp_refund_id": "re_1", "failure_code": "card_closed"}
    timeline = [
        entry("claimed", "EXT5_SENT", 1, 0),
        entry("outcome unknown, released", "EXT5_SENT", 1, 1),
        entry("taken over", "EXT5_SENT", 2, 2),
        entry("refund failed", "finished", 2, 3),
    ]

    d = layout(timeline, refund, finished=True, lease_live=False)

    assert [e.kind for e in d.events] == ["commit", "release", "takeover", "commit"]
    assert [(c.system, c.what, c.result) for c in d.calls] == [
        ("psp", "refund the card with K5", "unknown"),
        ("psp", "probe by K5, then refund the card with K5 only if not found", "applied"),
    ]
    assert d.calls[1].outcome == "failed · re_1 (card_closed)" and d.calls[1].key.startswith("K5 k5k5")


def test_a_refused_refund_is_the_commit_that_finished_it_and_calls_nothing():
    d = layout([entry("refused: refund-exceeds-payment", "finished", 1, 0)], {}, finished=True, lease_live=False)

    assert [e.kind for e in d.events] == ["commit"] and d.calls == []
