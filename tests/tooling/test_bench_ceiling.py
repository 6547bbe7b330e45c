"""The database-only ceiling records its pgbench script from the service's own request path."""

from __future__ import annotations

import asyncio

from bench.ceiling import record_one_payment, script


def test_one_new_payment_is_recorded_as_the_lookup_the_claim_and_two_fenced_phases():
    recorded = asyncio.run(record_one_payment("pk_test_recorded", 7))

    assert [r.issuer for r in recorded] == ["authentication.payment_caller", "phases.handler1", "engine.fenced",
                                            "engine.fenced"]
    text = script(recorded)
    assert [f"-- {n}. {r.issuer}" in text for n, r in enumerate(recorded, 1)] == [True] * 4
    assert "claim_idempotency_key(7, CAST(:k AS text), 'POST /v1/payments'" in text
