"""The crash matrix: kill a real process at every named point, then prove recovery.

For each crash point a real API process is started with PAYMENTS_CRASH_AT,
sent one payment, and dies there (os._exit: no clean-up, no response). Then
either (a) the client retries against another API process, or (b) nobody
retries and the recovery worker, a separate process, finishes the payment.
Either way the evidence is the same: one payment, one charge at the PSP, one
transfer at the rail (and one refund where the rail rejected), a balanced
ledger, the stored response, and a later retry that replays it byte for byte.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid

import httpx
import pytest

from app.payments.crash_points import POINTS
from tests.support import (
    charges, event_types, headers, key_row, ledger, payment_body, payments_for, refunds, requests_at, transfers,
    unbalanced_payments, until,
)

pytestmark = pytest.mark.usefixtures("stack")

# The recovery point a crash at each point leaves on the key row.
LEAVES = {
    "after-commit-EXT1_SENT": "EXT1_SENT",
    "after-call-EXT1": "EXT1_SENT",
    "after-commit-EXT2_SENT": "EXT2_SENT",
    "after-call-EXT2": "EXT2_SENT",
    "after-commit-EXT3_SENT": "EXT3_SENT",
    "after-call-EXT3": "EXT3_SENT",
    "after-commit-finished": "finished",
}
# Crashes die fast, and a dead owner's lease must run out before anyone may
# take over: one second keeps the suite quick.
DOOMED = {"LEASE_SECONDS": "1"}
FAST_WORKER = {"WORKER_MIN_AGE_SECONDS": "0", "WORKER_POLL_SECONDS": "0.1", "LEASE_SECONDS": "1"}


async def test_every_crash_point_on_the_payment_path_is_covered_by_this_matrix():
    # (The reconciliation job's own crash point is exercised in tests/reconciliation,
    # the webhook dispatcher's in tests/crash/test_webhook_delivery.py, the
    # returned payout's compensation's (EXT4) in tests/crash/test_returns.py, a
    # client refund's (EXT5) in tests/crash/test_refund_crashes.py.)
    assert set(LEAVES) == {
        point for point in POINTS
        if not point.startswith(("reconcile", "webhook")) and "EXT4" not in point and "EXT5" not in point
    }


async def lease_expired(db, client_id: int, key: str) -> None:
    async def expired() -> bool:
        return await db.fetchval(
            "SELECT lease_expires_at IS NULL OR lease_expires_at < now() FROM idempotency_key "
            "WHERE client_id = $1 AND key = $2", client_id, key,
        )

    await until(expired, "the dead owner's lease to expire (by the database clock)")


async def set_faults(http, service, *faults) -> None:
    (await http.put(service.url + "/_admin/faults", json={"faults": list(faults)})).raise_for_status()


async def crash(http, processes, acme, key, body, point) -> None:
    """Send the payment to an API process that dies at `point`."""
    doomed = processes.api("doomed", PAYMENTS_CRASH_AT=point, **DOOMED)
    with pytest.raises(httpx.HTTPError):
        await http.post(f"{doomed.url}/v1/payments", json=body, headers=headers(acme, key))
    assert doomed.popen.wait(10) == 137, "the process died at the crash point"


async def assert_exactly_once(http, stack, db, acme, key, body, *, rejected: bool) -> None:
    reference = body["reference"]
    [payment] = await payments_for(db, reference)
    assert len(await charges(db, reference)) == 1
    assert len(await transfers(db, reference)) == 1
    assert len(await refunds(db, reference)) == (1 if rejected else 0)
    assert payment["status"] == ("failed" if rejected else "succeeded")
    assert len(await ledger(db, payment["id"])) == (6 if rejected else 5)
    assert await unbalanced_payments(db) == []
    assert await event_types(db, payment["id"]) == [f"payment.{payment['status']}"], "one decision, one event"
    row = await key_row(db, acme.id, key)
    assert row["state"] == "finished" and row["response_code"] == 201
    replay = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.text == row["response_body"]


async def crashed_payment(http, stack, processes, acme, point) -> tuple[str, dict, bool]:
    """A payment whose API died at `point` (the EXT3 points need the rail to reject it)."""
    key, body = str(uuid.uuid4()), payment_body()
    rejected = "EXT3" in point
    if rejected:
        await set_faults(http, stack.rail, {"action": "reject", "reference": body["reference"]})
    await crash(http, processes, acme, key, body, point)
    return key, body, rejected


@pytest.mark.parametrize("point", list(LEAVES))
async def test_a_client_retry_after_a_crash_completes_the_payment_exactly_once(
    point, http, stack, db, acme, processes
):
    key, body, rejected = await crashed_payment(http, stack, processes, acme, point)

    assert (await key_row(db, acme.id, key))["recovery_point"] == LEAVES[point]
    await lease_expired(db, acme.id, key)
    retry = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))
    assert retry.status_code == 201, retry.text
    assert retry.json()["status"] == ("failed" if rejected else "succeeded")
    await assert_exactly_once(http, stack, db, acme, key, body, rejected=rejected)


@pytest.mark.parametrize("point", list(LEAVES))
async def test_the_worker_completes_a_crashed_payment_exactly_once_without_a_retry(
    point, http, stack, db, acme, processes
):
    key, body, rejected = await crashed_payment(http, stack, processes, acme, point)

    processes.worker(**FAST_WORKER)

    async def finished() -> bool:
        return (await key_row(db, acme.id, key))["state"] == "finished"

    await until(finished, "the worker to finish the payment")
    await assert_exactly_once(http, stack, db, acme, key, body, rejected=rejected)


@pytest.mark.parametrize("fault", ["hang_after", "error_after"])
@pytest.mark.parametrize("point", ["after-commit-EXT2_SENT", "after-call-EXT2"])
async def test_a_crash_around_a_rail_that_applied_but_never_answered_still_pays_out_once(
    point, fault, http, stack, db, acme, processes
):
    key, body = str(uuid.uuid4()), payment_body()
    await set_faults(http, stack.rail, {"action": fault, "reference": body["reference"], "seconds": 5})

    await crash(http, processes, acme, key, body, point)
    await lease_expired(db, acme.id, key)
    retry = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))

    assert retry.status_code == 201, retry.text
    await assert_exactly_once(http, stack, db, acme, key, body, rejected=False)


async def test_a_worker_killed_mid_recovery_is_followed_by_one_that_completes_it_once(
    http, stack, db, acme, processes
):
    key, body = str(uuid.uuid4()), payment_body()
    await crash(http, processes, acme, key, body, "after-commit-EXT1_SENT")

    first = processes.worker("worker-1", PAYMENTS_CRASH_AT="after-call-EXT1", **FAST_WORKER)
    assert first.wait(30) == 137, "the first worker died after charging, before recording it"
    assert len(await charges(db, body["reference"])) == 1
    assert (await key_row(db, acme.id, key))["recovery_point"] == "EXT1_SENT"

    processes.worker("worker-2", **FAST_WORKER)

    async def finished() -> bool:
        return (await key_row(db, acme.id, key))["state"] == "finished"

    await until(finished, "the second worker to finish the payment")
    await assert_exactly_once(http, stack, db, acme, key, body, rejected=False)
    assert (await key_row(db, acme.id, key))["attempts"] == 3


async def test_of_two_concurrent_retries_after_a_crash_exactly_one_takes_over(http, stack, db, acme, processes):
    key, body = str(uuid.uuid4()), payment_body()
    await crash(http, processes, acme, key, body, "after-commit-EXT1_SENT")
    await lease_expired(db, acme.id, key)
    # Keep the winner busy at the PSP while the loser arrives.
    await set_faults(http, stack.psp, {"action": "delay", "reference": body["reference"], "seconds": 1})

    responses = await asyncio.gather(
        *(http.post(f"{api.url}/v1/payments", json=body, headers=headers(acme, key)) for api in stack.apis)
    )

    assert sorted(r.status_code for r in responses) == [201, 409]
    assert (await key_row(db, acme.id, key))["attempts"] == 2, "one takeover, not two"
    await assert_exactly_once(http, stack, db, acme, key, body, rejected=False)


async def test_a_stalled_owner_cannot_commit_after_its_operation_was_taken_over(http, stack, db, acme, processes):
    # The stale commit must be tried while the operation is still `started`
    # under the new owner, where only the lease token can refuse it. So the
    # owner stalls at the rail (its commit there is the one that finishes the
    # payment), and the new owner is held at the rail longer still. (Stalled
    # at the charge instead, its statement would also be refused by the
    # ledger's unique (payment, posting, account): a second line of defence,
    # which would hide whether the fence works.) Both have rail timeouts
    # longer than these delays, so the stalled owner wakes to an answer.
    key, body = str(uuid.uuid4()), payment_body()
    stalled = processes.api("stalled", LEASE_SECONDS="1", RAIL_TIMEOUT_SECONDS="15")
    new_owner = processes.api("new-owner", RAIL_TIMEOUT_SECONDS="15")
    await set_faults(
        http, stack.rail,
        {"action": "delay", "reference": body["reference"], "seconds": 4},  # the stalled owner's transfer
        {"action": "delay", "reference": body["reference"], "seconds": 7},  # the new owner's
    )
    first = asyncio.create_task(http.post(f"{stalled.url}/v1/payments", json=body, headers=headers(acme, key)))

    async def transfers_asked(n: int) -> bool:
        return await requests_at(db, "rail", reference=body["reference"]) == [("POST", "/v1/transfers")] * n

    await until(lambda: transfers_asked(1), "the owner to send the transfer")
    os.kill(stalled.popen.pid, signal.SIGSTOP)  # a GC pause, a frozen VM, a swapped-out process
    try:
        await lease_expired(db, acme.id, key)
        retry = asyncio.create_task(
            http.post(f"{new_owner.url}/v1/payments", json=body, headers=headers(acme, key))
        )
        # The new owner took over at EXT2_SENT, probed (nothing yet) and sent
        # the transfer again with K2; the stalled owner's transfer has landed
        # meanwhile, so it will wake to the rail's answer.
        await until(lambda: transfers_asked(2), "the new owner to send the transfer")
        await until(lambda: transfers(db, body["reference"]), "the stalled owner's transfer to land")
        held = await key_row(db, acme.id, key)
        assert held["state"] == "started" and held["recovery_point"] == "EXT2_SENT" and held["attempts"] == 2
    finally:
        os.kill(stalled.popen.pid, signal.SIGCONT)

    late = await first
    # It woke up holding a stale lease and tried to finish the payment with
    # one statement: its fence matched no row, so nothing was written, and
    # it can only say someone else owns the request.
    assert late.status_code == 409, late.text
    after = await key_row(db, acme.id, key)
    assert after["state"] == "started", "the stale commit was tried while the new owner still held the operation"
    assert after == held, "no response, no timeline entry, no recovery point written by the stale owner"
    [payment] = await payments_for(db, body["reference"])
    assert payment["status"] == "processing"
    assert [entry[0] for entry in await ledger(db, payment["id"])] == ["charge_captured"] * 3, "no payout_sent"
    assert await event_types(db, payment["id"]) == [], "no event from the stale owner's refused statement"

    retry = await retry
    assert retry.status_code == 201, retry.text
    await assert_exactly_once(http, stack, db, acme, key, body, rejected=False)
    row = await key_row(db, acme.id, key)
    assert row["response_body"] == retry.text
    assert [e["event"] for e in json.loads(row["timeline"])] == [
        "claimed", "charge succeeded", "taken over", "transfer accepted",
    ]


# What each external system was asked, in order, after a crash at the point
# and one client retry: the dead process's requests, then the resumer's. A
# resumer probes first (GET), sends (POST, with the same derived key) only
# what the probe did not find, and never touches a step already recorded.
ASKED = {
    "after-commit-EXT1_SENT": {"charge": ["GET", "POST"], "transfer": ["POST"], "refund": []},
    "after-call-EXT1": {"charge": ["POST", "GET"], "transfer": ["POST"], "refund": []},
    "after-commit-EXT2_SENT": {"charge": ["POST"], "transfer": ["GET", "POST"], "refund": []},
    "after-call-EXT2": {"charge": ["POST"], "transfer": ["POST", "GET"], "refund": []},
    "after-commit-EXT3_SENT": {"charge": ["POST"], "transfer": ["POST"], "refund": ["GET", "POST"]},
    "after-call-EXT3": {"charge": ["POST"], "transfer": ["POST"], "refund": ["POST", "GET"]},
}


@pytest.mark.parametrize("point", list(ASKED))
async def test_a_resumer_probes_before_it_sends_and_never_resends_what_the_probe_found(
    point, http, stack, db, acme, processes
):
    key, body, rejected = await crashed_payment(http, stack, processes, acme, point)
    await lease_expired(db, acme.id, key)

    retry = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))

    assert retry.status_code == 201, retry.text
    [payment] = await payments_for(db, body["reference"])
    e2e = payment["end_to_end_reference"]
    asked = {
        "charge": await requests_at(db, "psp", idempotency_key=payment["psp_charge_key"]),
        "transfer": await requests_at(db, "rail", end_to_end_reference=e2e),
        "refund": await requests_at(db, "psp", idempotency_key=payment["psp_refund_key"] or "none"),
    }
    paths = {
        "charge": {"GET": "/v1/charges", "POST": "/v1/charges"},
        "transfer": {"GET": f"/v1/transfers/{e2e}", "POST": "/v1/transfers"},
        "refund": {"GET": "/v1/refunds", "POST": "/v1/refunds"},
    }
    assert asked == {
        call: [(method, paths[call][method]) for method in methods] for call, methods in ASKED[point].items()
    }
    await assert_exactly_once(http, stack, db, acme, key, body, rejected=rejected)


async def test_a_worker_stopped_with_sigterm_releases_the_operation_it_holds(http, stack, db, acme, processes):
    key, body = str(uuid.uuid4()), payment_body()
    await crash(http, processes, acme, key, body, "after-commit-EXT1_SENT")
    await set_faults(http, stack.psp, {"action": "delay", "reference": body["reference"], "seconds": 5})
    worker = processes.worker(**(FAST_WORKER | {"LEASE_SECONDS": "60"}))

    async def owned_by_worker() -> bool:
        return (await key_row(db, acme.id, key))["attempts"] == 2

    await until(owned_by_worker, "the worker to take the operation over")
    worker.send_signal(signal.SIGTERM)

    assert worker.wait(10) == 0
    row = await key_row(db, acme.id, key)
    assert row["state"] == "started" and row["lease_token"] is None, "released, not left to a 60 s lease"
    await set_faults(http, stack.psp)
    retry = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))
    assert retry.status_code == 201, retry.text
    await assert_exactly_once(http, stack, db, acme, key, body, rejected=False)


async def test_two_workers_racing_over_many_stranded_payments_resume_each_exactly_once(
    http, stack, db, acme, processes
):
    bodies = [payment_body() for _ in range(20)]
    await set_faults(http, stack.psp, {"action": "error_before", "status": 500, "times": len(bodies)})
    keys = [str(uuid.uuid4()) for _ in bodies]
    pending = await asyncio.gather(
        *(http.post(f"{stack.api}/v1/payments", json=b, headers=headers(acme, k)) for k, b in zip(keys, bodies))
    )
    assert {r.status_code for r in pending} == {202}
    await db.execute("UPDATE idempotency_key SET next_attempt_at = now()")

    processes.worker("worker-a", **FAST_WORKER)
    processes.worker("worker-b", **FAST_WORKER)

    async def all_finished() -> bool:
        return await db.fetchval("SELECT count(*) FROM idempotency_key WHERE state = 'finished'") == len(keys)

    await until(all_finished, "both workers to finish every payment")
    for key, body in zip(keys, bodies):
        await assert_exactly_once(http, stack, db, acme, key, body, rejected=False)
        # One takeover per operation: no phase ran under two owners.
        assert (await key_row(db, acme.id, key))["attempts"] == 2
