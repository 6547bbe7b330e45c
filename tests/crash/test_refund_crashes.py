"""A client's refund across crashes: a real API process killed at each of the refund's crash points.

The refund is the second operation on the machine (app/payments/refunds/refund.py),
so it gets the payment's matrix (tests/crash/test_crash_matrix.py) on its
own points. The payment is made first, on the normal stack: the point
`after-commit-finished` is shared with payments, and a doomed API must die
on the refund, not on the payment. Then the refund goes to an API process
started with PAYMENTS_CRASH_AT, which dies there (os._exit: no response, no
clean-up), and either (a) the client retries on another API process, or
(b) nobody retries and the recovery worker finishes it. Either way: one
refund at the PSP under K5, the refund row succeeded, the payment's
refunded amount raised by it once, one `refund:<id>` posting, a balanced
ledger, one `refund.succeeded` event, and the key row finished with a
response a later retry replays byte for byte.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from app.payments.crash_points import POINTS
from tests.crash.test_crash_matrix import lease_expired, set_faults
from tests.integration.test_refunds import paid
from tests.support import event_types, headers, key_row, ledger, refunds, requests_at, unbalanced_payments, until

pytestmark = pytest.mark.usefixtures("stack")

AMOUNT = 2500  # of the 10 000 paid: a partial refund, so "refunded once" and "refunded twice" differ
# The recovery point a crash at each of the refund's points leaves on its key row.
LEAVES = {
    "after-commit-EXT5_SENT": "EXT5_SENT",
    "after-call-EXT5": "EXT5_SENT",
    "after-commit-finished": "finished",
}
DOOMED = {"LEASE_SECONDS": "1"}
FAST_WORKER = {"WORKER_MIN_AGE_SECONDS": "0", "WORKER_POLL_SECONDS": "0.1", "LEASE_SECONDS": "1"}


async def test_every_crash_point_of_a_client_refund_is_covered_by_this_matrix():
    # after-commit-finished is the payment's too: it is in both matrices.
    assert {point for point in POINTS if "EXT5" in point} | {"after-commit-finished"} == set(LEAVES)


def refund_url(api: str, payment: dict) -> str:
    return f"{api}/v1/payments/{payment['id']}/refunds"


async def crashed_refund(http, stack, processes, acme, point: str) -> tuple[dict, str, dict]:
    """A paid payment (made on the normal stack) whose refund reached an API that died at `point`."""
    payment = await paid(http, stack, acme)
    key, body = str(uuid.uuid4()), {"amount": AMOUNT, "reference": f"rma-{uuid.uuid4()}"}
    doomed = processes.api("doomed", PAYMENTS_CRASH_AT=point, **DOOMED)
    with pytest.raises(httpx.HTTPError):
        await http.post(refund_url(doomed.url, payment), json=body, headers=headers(acme, key))
    assert doomed.popen.wait(10) == 137, "the process died at the crash point"
    return payment, key, body


async def the_refund(db, payment: dict):
    [refund] = await db.fetch("SELECT * FROM refund WHERE payment_id = $1", uuid.UUID(payment["id"]))
    return refund


async def assert_refunded_once(http, stack, db, acme, payment, key, body) -> None:
    pid = uuid.UUID(payment["id"])
    refund = await the_refund(db, payment)
    [at_psp] = await refunds(db, body["reference"])
    assert at_psp["idempotency_key"] == refund["psp_refund_key"] and at_psp["amount"] == AMOUNT
    assert at_psp["status"] == "succeeded" and at_psp["id"] == refund["psp_refund_id"]
    assert refund["status"] == "succeeded" and refund["amount_minor"] == AMOUNT
    assert await db.fetchval("SELECT refunded_minor FROM payment WHERE id = $1", pid) == AMOUNT
    posting = f"refund:{refund['id']}"
    assert [e for e in await ledger(db, pid) if e[0].startswith("refund:")] == [
        (posting, "client_receivable", AMOUNT, 0), (posting, "psp_receivable", 0, AMOUNT),
    ]
    assert await unbalanced_payments(db) == []
    assert await event_types(db, pid) == ["payment.succeeded", "refund.succeeded"], "one outcome, one event"
    row = await key_row(db, acme.id, key)
    assert row["state"] == "finished" and row["response_code"] == 201
    replay = await http.post(refund_url(stack.api, payment), json=body, headers=headers(acme, key))
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.text == row["response_body"]


async def finished(db, acme, key: str) -> None:
    async def is_finished() -> bool:
        return (await key_row(db, acme.id, key))["state"] == "finished"

    await until(is_finished, "the worker to finish the refund")


@pytest.mark.parametrize("point", list(LEAVES))
async def test_a_client_retry_after_a_crash_completes_the_refund_exactly_once(point, http, stack, db, acme, processes):
    payment, key, body = await crashed_refund(http, stack, processes, acme, point)

    assert (await key_row(db, acme.id, key))["recovery_point"] == LEAVES[point]
    await lease_expired(db, acme.id, key)
    retry = await http.post(refund_url(stack.apis[1].url, payment), json=body, headers=headers(acme, key))

    assert retry.status_code == 201, retry.text
    assert retry.json()["status"] == "succeeded" and retry.json()["amount"] == AMOUNT
    await assert_refunded_once(http, stack, db, acme, payment, key, body)


@pytest.mark.parametrize("point", list(LEAVES))
async def test_the_worker_completes_a_crashed_refund_exactly_once_without_a_retry(
    point, http, stack, db, acme, processes
):
    payment, key, body = await crashed_refund(http, stack, processes, acme, point)

    processes.worker(**FAST_WORKER)

    await finished(db, acme, key)
    await assert_refunded_once(http, stack, db, acme, payment, key, body)


# What the PSP was asked under K5, in order, after a crash at the point and
# one client retry: the dead process's requests, then the resumer's. The
# resumer probes first (GET) and sends (POST, with K5 again) only if the
# probe found nothing.
ASKED = {
    "after-commit-EXT5_SENT": ["GET", "POST"],
    "after-call-EXT5": ["POST", "GET"],
}


@pytest.mark.parametrize("point", list(ASKED))
async def test_a_resumed_refund_probes_the_psp_first_and_never_resends_what_the_probe_found(
    point, http, stack, db, acme, processes
):
    payment, key, body = await crashed_refund(http, stack, processes, acme, point)
    await lease_expired(db, acme.id, key)

    retry = await http.post(refund_url(stack.api, payment), json=body, headers=headers(acme, key))

    assert retry.status_code == 201, retry.text
    k5 = (await the_refund(db, payment))["psp_refund_key"]
    assert await requests_at(db, "psp", idempotency_key=k5) == [
        (method, "/v1/refunds") for method in ASKED[point]
    ]
    await assert_refunded_once(http, stack, db, acme, payment, key, body)


@pytest.mark.parametrize("finisher", ["a client retry", "the recovery worker"])
async def test_a_crash_before_a_failed_refund_is_recorded_gives_the_reservation_back_exactly_once(
    finisher, http, stack, db, acme, processes
):
    # The PSP takes the refund as pending and fails it at once (seconds 0):
    # the first answer is `pending` (202, released), and the next owner's
    # probe finds it failed. That owner is the doomed API, which dies after
    # the probe answered and before the failure is recorded.
    payment = await paid(http, stack, acme)
    pid = uuid.UUID(payment["id"])
    key, body = str(uuid.uuid4()), {"amount": AMOUNT, "reference": f"rma-{uuid.uuid4()}"}
    await set_faults(http, stack.psp,
                     {"action": "pending", "operation": "refund", "seconds": 0, "settles_as": "failed"})
    doomed = processes.api("doomed", PAYMENTS_CRASH_AT="after-call-EXT5", **DOOMED)
    first = await http.post(refund_url(doomed.url, payment), json=body, headers=headers(acme, key))
    assert first.status_code == 202 and first.json()["status"] == "pending", first.text
    assert await db.fetchval("SELECT refunded_minor FROM payment WHERE id = $1", pid) == AMOUNT, "reserved"
    with pytest.raises(httpx.HTTPError):
        await http.post(refund_url(doomed.url, payment), json=body, headers=headers(acme, key))
    assert doomed.popen.wait(10) == 137, "the process died after the PSP's failure, before recording it"
    assert (await the_refund(db, payment))["status"] == "pending"
    assert await db.fetchval("SELECT refunded_minor FROM payment WHERE id = $1", pid) == AMOUNT, "still reserved"

    if finisher == "a client retry":
        await lease_expired(db, acme.id, key)
        retry = await http.post(refund_url(stack.apis[1].url, payment), json=body, headers=headers(acme, key))
        assert retry.status_code == 201 and retry.json()["status"] == "failed", retry.text
    else:
        processes.worker(**FAST_WORKER)
        await finished(db, acme, key)

    refund = await the_refund(db, payment)
    assert refund["status"] == "failed"
    assert await db.fetchval("SELECT refunded_minor FROM payment WHERE id = $1", pid) == 0, "given back once"
    assert [e for e in await ledger(db, pid) if e[0].startswith("refund:")] == [], "nothing posted"
    assert await unbalanced_payments(db) == []
    assert await event_types(db, pid) == ["payment.succeeded", "refund.failed"]
    [at_psp] = await refunds(db, body["reference"])
    assert at_psp["status"] == "failed" and at_psp["idempotency_key"] == refund["psp_refund_key"]
    assert await requests_at(db, "psp", idempotency_key=refund["psp_refund_key"]) == [
        ("POST", "/v1/refunds"), ("GET", "/v1/refunds"), ("GET", "/v1/refunds"),
    ], "sent once; the doomed owner's probe, then the finisher's"
    row = await key_row(db, acme.id, key)
    assert row["state"] == "finished" and row["response_code"] == 201
    replay = await http.post(refund_url(stack.api, payment), json=body, headers=headers(acme, key))
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.text == row["response_body"]
