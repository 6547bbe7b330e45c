"""Indeterminate payouts on a legacy rail, settled by reconciliation.

The test rail has one legacy beneficiary bank (LEGACY_IBAN): no idempotency
keys, no status probe. A timeout or lost response there parks the payment as
indeterminate, and only the rail's statement can settle it. Everything runs
as real processes: the API, the fake PSP and rail, `payments reconcile` and
`payments worker`. The evidence is durable state on all three sides.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from tests.conftest import LEGACY_IBAN
from tests.support import (
    charges, event_types, headers, key_row, ledger, payment_body, payments_for, refunds, transfers,
    unbalanced_payments, until,
)

BOOKING_DAYS = 3  # the default RECONCILE_BOOKING_DAYS: absent means absent from all of these


def legacy_body() -> dict:
    return payment_body(beneficiary={"name": "Old Bank Customer", "iban": LEGACY_IBAN})


def today() -> str:
    return datetime.now(UTC).date().isoformat()


async def set_faults(http, service, *faults) -> None:
    (await http.put(service.url + "/_admin/faults", json={"faults": list(faults)})).raise_for_status()


async def close_days_through(http, stack, day) -> None:
    """Move the rail's calendar on: every day up to `day` is closed and final."""
    (await http.post(stack.rail.url + "/_admin/close-day", json={"date": str(day)})).raise_for_status()


async def park_a_legacy_payout(http, stack, db, acme, fault: dict) -> tuple[str, dict, dict]:
    key, body = str(uuid.uuid4()), legacy_body()
    await set_faults(http, stack.rail, {"reference": body["reference"], **fault})
    response = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))
    row = await key_row(db, acme.id, key)
    # Where the payment stopped and why, should it not be parked at the
    # payout (a 202 `processing` is a release, e.g. of the charge).
    stopped = f"{response.text} at {row['recovery_point']}: {row['last_error']}" if row else response.text
    assert response.status_code == 202, stopped
    assert response.json()["status"] == "indeterminate", stopped
    assert row["parked_at"] is not None and row["recovery_point"] == "EXT2_SENT", stopped
    return key, body, response.json()


async def assert_settled(http, stack, db, acme, key, body, *, status: str) -> None:
    reference = body["reference"]
    [payment] = await payments_for(db, reference)
    assert payment["status"] == status
    assert len(await charges(db, reference)) == 1
    assert len(await refunds(db, reference)) == (1 if status == "failed" else 0)
    assert len(await ledger(db, payment["id"])) == (6 if status == "failed" else 5)
    assert await unbalanced_payments(db) == []
    # Parked (the client heard "indeterminate"), then settled: one event each.
    assert await event_types(db, payment["id"]) == ["payment.indeterminate", f"payment.{status}"]
    row = await key_row(db, acme.id, key)
    assert row["state"] == "finished" and json.loads(row["response_body"])["status"] == status
    replay = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.text == row["response_body"]


async def test_a_hang_after_applying_on_the_legacy_rail_reconciles_to_success_with_one_transfer(
    http, stack, db, acme, processes
):
    key, body, parked = await park_a_legacy_payout(http, stack, db, acme, {"action": "hang_after", "seconds": 5})
    assert len(await transfers(db, body["reference"])) == 1, "the rail applied it; we could not know"

    retry = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))
    assert retry.status_code == 202 and retry.json()["id"] == parked["id"]
    assert retry.json()["status"] == "indeterminate"
    assert len(await transfers(db, body["reference"])) == 1, "a retry never sends to a legacy rail again"

    code, output = await processes.cli("reconcile", "--date", today())

    assert code == 0, output
    await assert_settled(http, stack, db, acme, key, body, status="succeeded")
    assert len(await transfers(db, body["reference"])) == 1
    run = await db.fetchrow("SELECT * FROM scheduled_run WHERE window_start = $1", datetime.now(UTC).date())
    assert run["state"] == "finished" and json.loads(run["counts"])["settled_succeeded"] == 1


async def test_a_failure_before_applying_reconciles_to_failed_with_one_refund(http, stack, db, acme, processes):
    key, body, _ = await park_a_legacy_payout(
        http, stack, db, acme, {"action": "error_before", "status": 500}
    )
    assert await transfers(db, body["reference"]) == []

    # Absent from today's statement proves nothing until every statement in
    # the rail's booking horizon (today and the next BOOKING_DAYS) is final.
    code, output = await processes.cli("reconcile", "--date", today())
    assert code == 0, output
    assert (await payments_for(db, body["reference"]))[0]["status"] == "indeterminate"
    assert await refunds(db, body["reference"]) == []

    await close_days_through(http, stack, datetime.now(UTC).date() + timedelta(days=BOOKING_DAYS))
    await db.execute("DELETE FROM scheduled_run")  # a new window, as if run the next day
    code, output = await processes.cli("reconcile", "--date", today())

    assert code == 0, output
    await assert_settled(http, stack, db, acme, key, body, status="failed")
    [refund] = await refunds(db, body["reference"])
    [charge] = await charges(db, body["reference"])
    assert refund["charge_id"] == charge["id"] and refund["amount"] == charge["amount"]
    assert await transfers(db, body["reference"]) == []


async def test_a_rerun_of_a_reconciled_window_does_nothing_twice(http, stack, db, acme, processes):
    key, body, _ = await park_a_legacy_payout(
        http, stack, db, acme, {"action": "error_before", "status": 500}
    )
    await close_days_through(http, stack, datetime.now(UTC).date() + timedelta(days=BOOKING_DAYS))
    assert (await processes.cli("reconcile", "--date", today()))[0] == 0

    code, output = await processes.cli("reconcile", "--date", today())

    assert code == 0 and "already reconciled" in output
    assert len(await refunds(db, body["reference"])) == 1
    assert await db.fetchval("SELECT attempts FROM scheduled_run") == 1


async def test_a_transfer_duplicated_by_the_legacy_rail_is_a_break_and_is_never_auto_corrected(
    http, stack, db, acme, processes
):
    key, body, parked = await park_a_legacy_payout(http, stack, db, acme, {"action": "hang_after", "seconds": 5})
    [first] = await transfers(db, body["reference"])
    # Someone (an old batch job, a person) sent the same payout again; the
    # legacy rail cannot tell and books it twice.
    again = await http.post(
        stack.rail.url + "/v1/transfers",
        json={k: first[k] for k in ("end_to_end_reference", "amount", "currency", "beneficiary_iban",
                                    "beneficiary_name", "reference")},
    )
    assert again.status_code == 201
    assert len(await transfers(db, body["reference"])) == 2

    code, output = await processes.cli("reconcile", "--date", today())

    assert code == 0, output
    [found] = await db.fetch("SELECT * FROM reconciliation_break")
    assert found["kind"] == "duplicate_booking" and str(found["payment_id"]) == parked["id"]
    assert found["end_to_end_reference"] == first["end_to_end_reference"]
    [payment] = await payments_for(db, body["reference"])
    assert payment["status"] == "indeterminate", "left for a person, never guessed"
    assert (await key_row(db, acme.id, key))["parked_at"] is not None
    code, listing = await processes.cli("breaks")
    assert code == 0 and "duplicate_booking" in listing and first["end_to_end_reference"] in listing


async def test_a_booked_transfer_that_matches_no_payment_is_a_break(http, stack, db, acme, processes):
    stray = await http.post(
        stack.rail.url + "/v1/transfers",
        headers={"Idempotency-Key": str(uuid.uuid4())},
        json={"end_to_end_reference": "E2ENOTOURS", "amount": 500, "currency": "EUR",
              "beneficiary_iban": LEGACY_IBAN, "beneficiary_name": "X", "reference": "stray"},
    )
    assert stray.status_code == 201

    assert (await processes.cli("reconcile", "--date", today()))[0] == 0

    [found] = await db.fetch("SELECT * FROM reconciliation_break")
    assert found["kind"] == "unmatched_transfer" and found["payment_id"] is None


async def test_two_reconcilers_racing_for_one_window_produce_one_run(http, stack, db, acme, processes):
    key, body, _ = await park_a_legacy_payout(
        http, stack, db, acme, {"action": "error_before", "status": 500}
    )
    await close_days_through(http, stack, datetime.now(UTC).date() + timedelta(days=BOOKING_DAYS))

    results = await asyncio.gather(*(processes.cli("reconcile", "--date", today()) for _ in range(2)))

    assert [code for code, _ in results] == [0, 0]
    assert sorted("already reconciled" in output for _, output in results) == [False, True]
    run = await db.fetchrow("SELECT * FROM scheduled_run")
    assert run["state"] == "finished" and run["attempts"] == 1
    assert len(await refunds(db, body["reference"])) == 1


async def test_two_workers_claim_yesterdays_window_once(db, stack, processes):
    workers = [
        processes.worker(name, RECONCILE_EVERY_SECONDS="0.1", WORKER_POLL_SECONDS="0.2")
        for name in ("worker-a", "worker-b")
    ]
    yesterday = datetime.now(UTC).date() - timedelta(days=1)

    async def finished() -> bool:
        state = await db.fetchval("SELECT state FROM scheduled_run WHERE window_start = $1", yesterday)
        return state == "finished"

    await until(finished, "a worker to reconcile yesterday")
    # Both keep trying every 0.1 s until they are stopped; none may run a
    # window twice (each covers the last BOOKING_DAYS + 1 closed days).
    for worker in workers:
        worker.terminate()
    assert [worker.wait(10) for worker in workers] == [0, 0]
    # (The workers' other daily job, the key table's upkeep, has rows of its own.)
    rows = await db.fetch("SELECT * FROM scheduled_run WHERE job = 'reconcile-rail'")
    assert len(rows) == BOOKING_DAYS + 1
    assert {(r["attempts"], r["state"]) for r in rows} == {(1, "finished")}


async def test_a_reconciliation_killed_halfway_is_finished_once_by_the_next_run(
    http, stack, db, acme, processes
):
    parked = [
        await park_a_legacy_payout(http, stack, db, acme, {"action": "error_before", "status": 500})
        for _ in range(3)
    ]
    await close_days_through(http, stack, datetime.now(UTC).date() + timedelta(days=BOOKING_DAYS))

    code, output = await processes.cli(
        "reconcile", "--date", today(), PAYMENTS_CRASH_AT="reconcile-after-settlement",
        RECONCILE_LEASE_SECONDS="1", LEASE_SECONDS="1",
    )

    assert code == 137, output
    statuses = [(await payments_for(db, body["reference"]))[0]["status"] for _, body, _ in parked]
    assert sorted(statuses) == ["indeterminate", "indeterminate", "processing"], "one settled, then the crash"
    assert await db.fetchval("SELECT state FROM scheduled_run") == "started"

    async def run_lease_expired() -> bool:
        return await db.fetchval("SELECT lease_expires_at < now() FROM scheduled_run")

    await until(run_lease_expired, "the dead run's lease to expire")
    code, output = await processes.cli("reconcile", "--date", today())
    assert code == 0, output
    run = await db.fetchrow("SELECT * FROM scheduled_run")
    assert run["state"] == "finished" and run["attempts"] == 2

    # The payment settled just before the crash waits at EXT3_SENT (refund
    # intended); resuming that is the recovery worker's job, by K3, once.
    processes.worker(WORKER_MIN_AGE_SECONDS="0", WORKER_POLL_SECONDS="0.1")

    async def all_refunded() -> bool:
        return await db.fetchval("SELECT count(*) FROM payment WHERE status = 'failed'") == 3

    await until(all_refunded, "every payment to be refunded")
    for key, body, _ in parked:
        await assert_settled(http, stack, db, acme, key, body, status="failed")


@pytest.mark.parametrize("point, transfers_made", [("after-commit-EXT2_SENT", 0), ("after-call-EXT2", 1)])
async def test_a_crash_around_a_legacy_payout_parks_it_and_never_sends_it_twice(
    point, transfers_made, http, stack, db, acme, processes
):
    key, body = str(uuid.uuid4()), legacy_body()
    doomed = processes.api("doomed", PAYMENTS_CRASH_AT=point, LEASE_SECONDS="1")
    with pytest.raises(Exception):
        await http.post(f"{doomed.url}/v1/payments", json=body, headers=headers(acme, key))
    assert doomed.popen.wait(10) == 137

    async def lease_expired() -> bool:
        return await db.fetchval("SELECT lease_expires_at < now() FROM idempotency_key WHERE key = $1", key)

    await until(lease_expired, "the dead owner's lease to expire")
    retry = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))

    assert retry.status_code == 202 and retry.json()["status"] == "indeterminate"
    assert len(await transfers(db, body["reference"])) == transfers_made
    await close_days_through(http, stack, datetime.now(UTC).date() + timedelta(days=BOOKING_DAYS))
    assert (await processes.cli("reconcile", "--date", today()))[0] == 0
    await assert_settled(http, stack, db, acme, key, body, status="succeeded" if transfers_made else "failed")
    assert len(await transfers(db, body["reference"])) == transfers_made


def day(offset: int):
    return datetime.now(UTC).date() + timedelta(days=offset)


async def rebook(http, stack, transfer, **changes) -> None:
    """Send a payout straight to the legacy rail again (as an old batch job might)."""
    fields = ("end_to_end_reference", "amount", "currency", "beneficiary_iban", "beneficiary_name", "reference")
    again = await http.post(stack.rail.url + "/v1/transfers", json={f: transfer[f] for f in fields} | changes)
    assert again.status_code == 201


async def test_a_payout_booked_late_within_the_horizon_is_found_not_refunded(http, stack, db, acme, processes):
    # Today and tomorrow are already closed: the rail books it the day after.
    await close_days_through(http, stack, day(1))
    key, body, _ = await park_a_legacy_payout(http, stack, db, acme, {"action": "hang_after", "seconds": 5})
    [transfer] = await transfers(db, body["reference"])
    assert transfer["booking_date"] == day(2)
    await close_days_through(http, stack, day(BOOKING_DAYS))

    code, output = await processes.cli("reconcile", "--date", today())

    assert code == 0, output
    await assert_settled(http, stack, db, acme, key, body, status="succeeded")
    assert await refunds(db, body["reference"]) == []


async def test_an_amount_that_differs_from_the_payment_is_a_break(http, stack, db, acme, processes):
    key, body, _ = await park_a_legacy_payout(http, stack, db, acme, {"action": "error_before", "status": 500})
    [payment] = await payments_for(db, body["reference"])
    await rebook(http, stack, {
        "end_to_end_reference": payment["end_to_end_reference"], "amount": payment["net_minor"] + 1,
        "currency": "EUR", "beneficiary_iban": LEGACY_IBAN, "beneficiary_name": "X", "reference": body["reference"],
    })

    assert (await processes.cli("reconcile", "--date", today()))[0] == 0

    [found] = await db.fetch("SELECT * FROM reconciliation_break")
    assert found["kind"] == "amount_mismatch" and found["payment_id"] == payment["id"]
    assert (await payments_for(db, body["reference"]))[0]["status"] == "indeterminate"
    assert await refunds(db, body["reference"]) == []


async def test_a_second_booking_on_a_later_day_of_a_settled_payout_is_a_break(http, stack, db, acme, processes):
    key, body, _ = await park_a_legacy_payout(http, stack, db, acme, {"action": "hang_after", "seconds": 5})
    assert (await processes.cli("reconcile", "--date", today()))[0] == 0
    await assert_settled(http, stack, db, acme, key, body, status="succeeded")
    [transfer] = await transfers(db, body["reference"])
    await close_days_through(http, stack, day(0))
    await rebook(http, stack, transfer)  # booked tomorrow
    await close_days_through(http, stack, day(1))

    assert (await processes.cli("reconcile", "--date", str(day(1))))[0] == 0

    [found] = await db.fetch("SELECT * FROM reconciliation_break")
    assert found["kind"] == "duplicate_booking"
    assert (await payments_for(db, body["reference"]))[0]["status"] == "succeeded", "never auto-corrected"


async def test_a_booking_for_a_payout_we_refunded_is_a_break(http, stack, db, acme, processes):
    key, body, _ = await park_a_legacy_payout(http, stack, db, acme, {"action": "error_before", "status": 500})
    await close_days_through(http, stack, day(BOOKING_DAYS))
    assert (await processes.cli("reconcile", "--date", today()))[0] == 0
    await assert_settled(http, stack, db, acme, key, body, status="failed")
    [payment] = await payments_for(db, body["reference"])
    late = {"end_to_end_reference": payment["end_to_end_reference"], "amount": payment["net_minor"],
            "currency": "EUR", "beneficiary_iban": LEGACY_IBAN, "beneficiary_name": "X",
            "reference": body["reference"]}
    await rebook(http, stack, late)  # beyond the horizon: booked after every day we closed
    late_day = day(BOOKING_DAYS + 1)
    await close_days_through(http, stack, late_day)

    assert (await processes.cli("reconcile", "--date", str(late_day)))[0] == 0

    [found] = await db.fetch("SELECT * FROM reconciliation_break")
    assert found["kind"] == "unexpected_booking" and found["payment_id"] == payment["id"]
