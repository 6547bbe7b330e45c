"""Returned payouts across crashes: real processes killed at the return's crash points.

Three gaps, each closed by durable state and nothing else:

* our process dies between recording a return and acknowledging it to the
  rail (after-commit-EXT4_SENT): the rail delivers the notification again,
  the inbox drops it, and the compensation is finished by that redelivery
  or by the recovery worker, once;
* our process dies inside the compensation, after the PSP refunded and
  before the refund is recorded (after-call-EXT4): the next owner probes
  the PSP by K4 and records that refund: one refund, never two;
* the notification arrives before our side recorded the transfer's outcome
  (our process died between the rail accepting and our record): it is
  refused (409) until the payment is resumed, then applied once.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import httpx
import pytest
from standardwebhooks import Webhook

from tests.conftest import RAIL_SECRET
from tests.crash.test_crash_matrix import lease_expired
from tests.integration.test_returns import (
    NOTIFICATIONS, assert_returned_once, notifications, paid_out, return_payout, status_is,
)
from tests.support import (
    charges, headers, key_row, payment_body, payments_for, refunds, requests_at, transfers, until,
)

pytestmark = pytest.mark.usefixtures("stack")

FAST_WORKER = {"WORKER_MIN_AGE_SECONDS": "0", "WORKER_POLL_SECONDS": "0.1", "LEASE_SECONDS": "1"}


async def notify(http, stack, url: str) -> None:
    (await http.put(stack.rail.url + "/_admin/notify", json={"url": url + NOTIFICATIONS, "secret": RAIL_SECRET})
     ).raise_for_status()


async def returned_to_a_dying_api(http, stack, db, acme, processes, point: str):
    """A paid-out payment returned by the rail, whose notification reaches an API that dies at `point`."""
    key, body, created = await paid_out(http, stack, acme)
    doomed = processes.api("doomed", PAYMENTS_CRASH_AT=point, LEASE_SECONDS="1")
    await notify(http, stack, doomed.url)
    await return_payout(http, stack, created["end_to_end_reference"])
    assert doomed.popen.wait(30) == 137, "the API died at the crash point"
    [payment] = await payments_for(db, body["reference"])
    assert payment["status"] == "returned"
    compensation = f"@return:{payment['return_id']}"
    assert (await key_row(db, acme.id, compensation))["recovery_point"] == "EXT4_SENT"
    await lease_expired(db, acme.id, compensation)
    return key, body, created, payment


async def redeliver_as_a_duplicate(http, stack, n: dict) -> None:
    """The rail's notification `n` once more, signed as its notifier would send it: answered as a duplicate."""
    text = json.dumps(n["body"])
    now = datetime.now(UTC)
    sent = {"content-type": "application/json", "webhook-id": n["id"],
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": Webhook(RAIL_SECRET).sign(n["id"], now, text)}
    again = await http.post(stack.api + NOTIFICATIONS, content=text.encode(), headers=sent)
    assert again.status_code == 200 and again.json()["outcome"] == "duplicate", again.text


async def redelivered(http, stack) -> None:
    async def delivered() -> bool:
        return (await notifications(http, stack))[0]["state"] == "delivered"

    await until(delivered, "the rail to deliver its notification")


@pytest.mark.parametrize("finisher", ["the rail's redelivery", "the recovery worker"])
async def test_a_crash_between_recording_a_return_and_acknowledging_it_drops_the_redelivery(
    finisher, http, stack, db, acme, processes
):
    key, body, created, payment = await returned_to_a_dying_api(
        http, stack, db, acme, processes, "after-commit-EXT4_SENT"
    )
    [n] = await notifications(http, stack)
    assert n["state"] == "pending" and n["deliveries"][0]["outcome"] in ("connection", "timeout"), "never acknowledged"
    assert await refunds(db, body["reference"]) == []

    if finisher == "the recovery worker":
        processes.worker(**FAST_WORKER)
        await status_is(db, body["reference"], "refunded")
    await notify(http, stack, stack.api)
    await redelivered(http, stack)
    await status_is(db, body["reference"], "refunded")

    message = await assert_returned_once(http, stack, db, acme, key, body, created)
    assert message["duplicates"] == 1, "the redelivery was dropped"
    assert len(await refunds(db, body["reference"])) == 1


@pytest.mark.parametrize("finisher", ["a redelivery", "the recovery worker"])
async def test_a_crash_after_the_compensating_refund_was_sent_is_finished_with_that_one_refund(
    finisher, http, stack, db, acme, processes
):
    key, body, created, payment = await returned_to_a_dying_api(
        http, stack, db, acme, processes, "after-call-EXT4"
    )
    # The rail was acknowledged before the refund was made; the PSP refunded; we died before recording it.
    [n] = await notifications(http, stack)
    assert n["state"] == "delivered"
    assert len(await refunds(db, body["reference"])) == 1

    if finisher == "the recovery worker":
        processes.worker(**FAST_WORKER)
    else:
        # The rail's message once more, as its notifier would send it again:
        # a duplicate, which resumes the stranded compensation like a retry.
        await redeliver_as_a_duplicate(http, stack, n)
    await status_is(db, body["reference"], "refunded")

    await assert_returned_once(http, stack, db, acme, key, body, created)
    refund_key = payment["psp_refund_key"]
    assert await requests_at(db, "psp", idempotency_key=refund_key) == [
        ("POST", "/v1/refunds"), ("GET", "/v1/refunds"),
    ], "the resumer probed by K4, found the refund, and sent nothing"


async def test_a_notification_before_the_transfer_is_recorded_is_refused_until_it_is_then_applied_once(
    http, stack, db, acme, processes
):
    key, body = str(uuid.uuid4()), payment_body()
    doomed = processes.api("doomed", PAYMENTS_CRASH_AT="after-call-EXT2", LEASE_SECONDS="1")
    with pytest.raises(httpx.HTTPError):
        await http.post(f"{doomed.url}/v1/payments", json=body, headers=headers(acme, key))
    assert doomed.popen.wait(10) == 137
    [payment] = await payments_for(db, body["reference"])
    assert payment["status"] == "processing" and payment["rail_transfer_id"] is None
    # The rail accepted the transfer and returns it before we recorded that it accepted it.
    await return_payout(http, stack, payment["end_to_end_reference"])

    async def refused() -> bool:
        [n] = await notifications(http, stack)
        return any(d["status_code"] == 409 for d in n["deliveries"])

    await until(refused, "the rail's notification to be refused as too early")
    assert await db.fetchval("SELECT count(*) FROM rail_message") == 0, "nothing recorded while too early"
    assert (await payments_for(db, body["reference"]))[0]["status"] == "processing"

    # The client's retry resumes the payment: it probes the rail and records the acceptance.
    await lease_expired(db, acme.id, key)
    retry = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))
    assert retry.status_code == 201 and retry.json()["status"] == "succeeded", retry.text
    # The rail retries until answered 2xx: now the return applies.
    await status_is(db, body["reference"], "refunded")

    await assert_returned_once(http, stack, db, acme, key, body, retry.json())
    assert len(await charges(db, body["reference"])) == 1
    assert len(await transfers(db, body["reference"])) == 1


@pytest.mark.parametrize("finisher", ["a redelivery", "the recovery worker"])
async def test_a_return_after_a_client_refund_compensates_only_what_is_left_across_a_crash(
    finisher, http, stack, db, acme, processes
):
    """The compensation's amount is what the client's refunds left, fixed when the return is recorded."""
    key, body, created = await paid_out(http, stack, acme)
    partial = await http.post(f"{stack.api}/v1/payments/{created['id']}/refunds",
                              json={"amount": 400, "reference": "rma-before-return"},
                              headers=headers(acme, str(uuid.uuid4())))
    assert partial.status_code == 201 and partial.json()["status"] == "succeeded", partial.text
    doomed = processes.api("doomed", PAYMENTS_CRASH_AT="after-call-EXT4", LEASE_SECONDS="1")
    await notify(http, stack, doomed.url)
    await return_payout(http, stack, created["end_to_end_reference"])
    assert doomed.popen.wait(30) == 137, "the API died after the PSP refunded, before recording it"
    [payment] = await payments_for(db, body["reference"])
    assert payment["status"] == "returned" and payment["return_refund_minor"] == body["amount"] - 400
    compensation = f"@return:{payment['return_id']}"
    await lease_expired(db, acme.id, compensation)

    if finisher == "the recovery worker":
        processes.worker(**FAST_WORKER)
    else:
        [n] = await notifications(http, stack)
        await redeliver_as_a_duplicate(http, stack, n)
    await status_is(db, body["reference"], "refunded")

    [payment] = await payments_for(db, body["reference"])
    at_psp = await db.fetch("SELECT * FROM fake_psp.refund WHERE charge_id = $1 ORDER BY created_at",
                            payment["psp_charge_id"])
    assert [(r["amount"], r["idempotency_key"] == payment["psp_refund_key"]) for r in at_psp] == [
        (400, False), (body["amount"] - 400, True),
    ], "the client's refund, then one compensation of what it left"
    assert not any(r["over_refund"] for r in at_psp)
    assert await requests_at(db, "psp", idempotency_key=payment["psp_refund_key"]) == [
        ("POST", "/v1/refunds"), ("GET", "/v1/refunds"),
    ], "the resumer probed by K4, found the refund, and sent nothing"
    assert payment["refunded_minor"] == body["amount"]
    balances = await db.fetch(
        "SELECT account, sum(debit_minor) - sum(credit_minor) AS balance FROM ledger_entry "
        "WHERE payment_id = $1 GROUP BY account", payment["id"])
    assert {r["account"]: r["balance"] for r in balances} == {
        "psp_receivable": 0, "beneficiary_payable": 0, "fee_revenue": 0, "rail_settlement": 0,
        "client_receivable": 0,
    }, "every account of the payment back at zero"
    refused = await http.post(f"{stack.api}/v1/payments/{created['id']}/refunds", json={"reference": "late"},
                              headers=headers(acme, str(uuid.uuid4())))
    assert refused.status_code == 409 and refused.json()["type"] == "/problems/payment-not-refundable"
