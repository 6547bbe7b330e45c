"""The classic test: fire the same request 100 times at once, at two API processes.

The processes share one database and nothing else, so the only thing that can
make them agree is the database: the key INSERT's unique constraint and the
conditional takeover. The evidence is durable: one payment, one charge at the
PSP, one transfer at the rail, one balanced set of ledger entries.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from tests.support import charges, headers, ledger, payment_body, payments_for, transfers, unbalanced_payments

pytestmark = pytest.mark.usefixtures("stack")


async def test_the_same_request_fired_100_times_at_two_processes_pays_exactly_once(http, stack, db, acme):
    key, body = str(uuid.uuid4()), payment_body()
    # PSP latency keeps the first attempt in flight while the rest arrive: long
    # enough for a busy machine (with 0.5 s, a run on a loaded 2-CPU host once
    # answered every other request after the owner had finished), and within
    # the stack's PSP_TIMEOUT_SECONDS, so the owner still hears the charge.
    (await http.put(stack.psp.url + "/_admin/faults",
                    json={"faults": [{"action": "delay", "reference": body["reference"], "seconds": 1.2}]})).raise_for_status()
    targets = [stack.apis[i % 2].url for i in range(100)]

    responses = await asyncio.gather(
        *(http.post(f"{url}/v1/payments", json=body, headers=headers(acme, key)) for url in targets)
    )

    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {201, 409}, statuses
    # The race really happened: some requests met the owner in flight (the
    # PSP's delay holds it there) and were told so, instead of all arriving
    # after it had finished and being answered by replays.
    assert 409 in statuses, "no request overlapped the first one: the test raced nothing"
    created = [r for r in responses if r.status_code == 201]
    assert created, "at least the owner answers 201"
    assert len({r.content for r in created}) == 1, "every 201 carries the identical stored body"
    assert sum("Idempotent-Replayed" not in r.headers for r in created) == 1, "exactly one attempt did the work"
    assert all(r.json()["type"] == "/problems/request-in-progress" for r in responses if r.status_code == 409)

    [payment] = await payments_for(db, body["reference"])
    assert len(await charges(db, body["reference"])) == 1
    assert len(await transfers(db, body["reference"])) == 1
    assert len(await ledger(db, payment["id"])) == 5
    assert await unbalanced_payments(db) == []
    assert await db.fetchval("SELECT count(*) FROM idempotency_key") == 1
