"""The recovery worker's rules: backoff between attempts, and parking at the end.

Crash recovery itself is proven on real processes in tests/crash/. Here a sweep
runs in the test's own process (same code as `payments worker`, against the
same database and fake rails), so each rule can be checked one sweep at a time.
"""

from __future__ import annotations

import uuid

import pytest

from app.config import Settings
from app.services import open_services
from app.workers.recovery import sweep_once
from tests.support import charges, headers, key_row, payment_body, transfers


@pytest.fixture
async def worker_services(database_url, stack):
    async with _services(database_url, stack) as services:
        yield services


@pytest.fixture
async def one_attempt_worker(database_url, stack):
    async with _services(database_url, stack, max_attempts=1) as services:
        yield services


def _services(database_url, stack, **settings):
    return open_services(
        Settings(
            database_url=database_url, psp_url=stack.psp.url, rail_url=stack.rail.url, worker_min_age_seconds=0,
            **settings,
        )
    )


async def set_faults(http, service, *faults) -> None:
    (await http.put(service.url + "/_admin/faults", json={"faults": list(faults)})).raise_for_status()


async def test_the_worker_waits_out_the_backoff_then_finishes_the_payment_once(
    http, stack, db, acme, worker_services
):
    key, body = str(uuid.uuid4()), payment_body()
    await set_faults(http, stack.psp, {"action": "error_before", "status": 500, "reference": body["reference"]})
    pending = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))
    assert pending.status_code == 202

    assert await db.fetchval(
        "SELECT next_attempt_at > now() FROM idempotency_key WHERE key = $1", key
    ), "released with a backoff before the next attempt"
    assert (await sweep_once(worker_services)).found == 0, "not due yet"

    await db.execute("UPDATE idempotency_key SET next_attempt_at = now() WHERE key = $1", key)
    assert (await sweep_once(worker_services)).finished == 1

    row = await key_row(db, acme.id, key)
    assert row["state"] == "finished" and row["attempts"] == 2
    assert len(await charges(db, body["reference"])) == 1
    assert len(await transfers(db, body["reference"])) == 1


async def test_an_outcome_that_stays_unknown_is_parked_as_indeterminate_never_failed(
    http, stack, db, acme, processes, one_attempt_worker
):
    key, body = str(uuid.uuid4()), payment_body()
    api = processes.api("one-attempt", MAX_ATTEMPTS="1")
    await set_faults(
        http, stack.psp, {"action": "error_before", "status": 500, "reference": body["reference"], "times": None}
    )

    parked = await http.post(f"{api.url}/v1/payments", json=body, headers=headers(acme, key))

    assert parked.status_code == 202 and parked.json()["status"] == "indeterminate"
    row = await key_row(db, acme.id, key)
    assert row["state"] == "started" and row["parked_at"] is not None and row["lease_token"] is None
    again = await http.post(f"{api.url}/v1/payments", json=body, headers=headers(acme, key))
    assert again.status_code == 202 and again.json()["status"] == "indeterminate"
    shown = await http.get(f"{stack.api}/v1/payments/{parked.json()['id']}", headers=acme.auth)
    assert shown.json()["status"] == "indeterminate"
    await db.execute("UPDATE idempotency_key SET next_attempt_at = now() - interval '1 hour'")
    swept = await sweep_once(one_attempt_worker)
    assert swept.found == 0, "the recovery sweep never resumes a parked operation"
    # Its re-probe, once due, asks the PSP: no charge with K1, so it is sent
    # again with K1, refused again (the fault holds), and parked again.
    assert swept.healed == 1
    row = await key_row(db, acme.id, key)
    assert row["parked_at"] is not None and row["attempts"] == 2 and row["lease_token"] is None
    assert await charges(db, body["reference"]) == []
