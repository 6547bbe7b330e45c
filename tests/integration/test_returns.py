"""Returned payouts: the rail's notification through our inbox, the compensation, the statement backstop.

Real processes: the API, the fake PSP and the fake rail, whose notifier
POSTs each return to the first API (set by `clean`) until it answers 2xx.
The evidence is durable state: the inbox (`rail_message`), the payment and
its ledger, the events, and the fakes' own records (the PSP's refunds, the
rail's notification attempts).
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import pytest
from standardwebhooks import Webhook

from tests.conftest import RAIL_SECRET
from tests.support import (
    event_types, headers, key_row, ledger, payment_body, payments_for, refunds, unbalanced_payments, until,
)

NOTIFICATIONS = "/v1/rail/notifications"


async def set_faults(http, service, *faults) -> None:
    (await http.put(service.url + "/_admin/faults", json={"faults": list(faults)})).raise_for_status()


async def paid_out(http, stack, acme) -> tuple[str, dict, dict]:
    key, body = str(uuid.uuid4()), payment_body()
    response = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))
    assert response.status_code == 201 and response.json()["status"] == "succeeded", response.text
    return key, body, response.json()


async def return_payout(http, stack, e2e: str, reason: str = "AC04") -> dict:
    response = await http.post(
        stack.rail.url + "/_admin/return", json={"end_to_end_reference": e2e, "reason_code": reason}
    )
    assert response.status_code == 201, response.text
    return response.json()


async def notifications(http, stack) -> list[dict]:
    return (await http.get(stack.rail.url + "/_admin/notifications")).json()["items"]


async def status_is(db, reference: str, status: str) -> None:
    async def reached() -> bool:
        return (await payments_for(db, reference))[0]["status"] == status

    await until(reached, f"payment {reference} to be {status}")


async def assert_returned_once(http, stack, db, acme, key, body, created) -> dict:
    """One return, one compensation (one refund at the PSP), a balanced ledger, the original response replayed."""
    reference = body["reference"]
    [payment] = await payments_for(db, reference)
    assert payment["status"] == "refunded"
    [refund] = await refunds(db, reference)
    assert refund["amount"] == body["amount"] and refund["idempotency_key"] == payment["psp_refund_key"]
    postings = [p for p, *_ in await ledger(db, payment["id"])]
    assert postings.count("payout_returned") == 2 and postings.count("charge_refunded") == 3
    assert await unbalanced_payments(db) == []
    assert await event_types(db, payment["id"]) == ["payment.succeeded", "payment.returned", "payment.refunded"]
    [message] = await db.fetch(
        "SELECT * FROM rail_message WHERE payment_id = $1 AND outcome = 'applied'", payment["id"]
    )
    # The compensation is an operation of its own, finished; the payment's own key row is untouched.
    compensation = await key_row(db, acme.id, f"@return:{payment['return_id']}")
    assert compensation["state"] == "finished" and compensation["recovery_point"] == "finished"
    row = await key_row(db, acme.id, key)
    replay = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.text == row["response_body"]
    assert replay.json()["status"] == "succeeded", "a replay answers the response first stored"
    now = (await http.get(f"{stack.api}/v1/payments/{created['id']}", headers=acme.auth)).json()
    assert now["status"] == "refunded" and now["failure"]["code"] == "AC04"
    return dict(message)


async def test_a_return_delivered_three_times_is_applied_once_and_refunded_once(http, stack, db, acme):
    key, body, created = await paid_out(http, stack, acme)
    await set_faults(http, stack.rail, {"action": "duplicate", "operation": "notification", "times": 2})

    returned = await return_payout(http, stack, created["end_to_end_reference"])

    async def delivered_three_times() -> bool:
        [n] = await notifications(http, stack)
        return n["state"] == "delivered" and len([d for d in n["deliveries"] if d["outcome"] == "delivered"]) == 3

    await until(delivered_three_times, "the rail to deliver its notification three times")
    await status_is(db, body["reference"], "refunded")
    message = await assert_returned_once(http, stack, db, acme, key, body, created)
    assert message["duplicates"] == 2 and message["source"] == "notification"
    [n] = await notifications(http, stack)
    assert message["message_id"] == n["id"] and message["return_id"] == returned["return_id"]


async def test_returns_delivered_out_of_order_are_each_applied_once(http, stack, db, acme):
    first = await paid_out(http, stack, acme)
    second = await paid_out(http, stack, acme)
    # The first return's notification is held back: the second one's arrives first.
    await set_faults(http, stack.rail, {"action": "delay", "operation": "notification",
                                        "reference": first[1]["reference"], "seconds": 1.0})
    await return_payout(http, stack, first[2]["end_to_end_reference"])
    await return_payout(http, stack, second[2]["end_to_end_reference"])

    await status_is(db, first[1]["reference"], "refunded")
    await status_is(db, second[1]["reference"], "refunded")
    applied = await db.fetch("SELECT end_to_end_reference FROM rail_message ORDER BY received_at")
    assert [r["end_to_end_reference"] for r in applied] == [
        second[2]["end_to_end_reference"], first[2]["end_to_end_reference"]
    ], "the second return was recorded first"
    for key, body, created in (first, second):
        await assert_returned_once(http, stack, db, acme, key, body, created)


def signed(body: dict, secret: str = RAIL_SECRET, message_id: str | None = None) -> tuple[bytes, dict]:
    message_id = message_id or body["id"]
    text = json.dumps(body)
    return text.encode(), {
        "content-type": "application/json",
        "webhook-id": message_id,
        "webhook-timestamp": str(int(datetime.now(UTC).timestamp())),
        "webhook-signature": Webhook(secret).sign(message_id, datetime.now(UTC), text),
    }


def notification(e2e: str, *, transfer_id: str = "tr_x", amount: int = 1000, reason: str = "AC04") -> dict:
    return {
        "id": f"msg_{uuid.uuid4().hex[:12]}",
        "type": "transfer.returned",
        "data": {"return_id": f"rt_{uuid.uuid4().hex[:12]}", "transfer_id": transfer_id,
                 "end_to_end_reference": e2e, "amount": amount, "currency": "EUR", "reason_code": reason},
    }


async def nothing_recorded(db, reference: str) -> None:
    assert await db.fetchval("SELECT count(*) FROM rail_message") == 0
    assert await db.fetchval("SELECT count(*) FROM reconciliation_break") == 0
    [payment] = await payments_for(db, reference)
    assert payment["status"] == "succeeded" and payment["return_id"] is None


@pytest.mark.parametrize("forge", ["another secret", "no signature", "stale", "body changed"])
async def test_a_notification_not_signed_by_the_rail_is_401_and_records_nothing(forge, http, stack, db, acme):
    _, body, created = await paid_out(http, stack, acme)
    payment = (await payments_for(db, body["reference"]))[0]
    message = notification(created["end_to_end_reference"], transfer_id=payment["rail_transfer_id"],
                           amount=payment["net_minor"])
    content, sent = signed(message, secret="whsec_" + "QUJD" * 8 if forge == "another secret" else RAIL_SECRET)
    if forge == "no signature":
        del sent["webhook-signature"]
    if forge == "stale":
        sent["webhook-timestamp"] = str(int(datetime.now(UTC).timestamp()) - 3600)
    if forge == "body changed":
        content = content.replace(b'"AC04"', b'"AC01"')

    response = await http.post(stack.api + NOTIFICATIONS, content=content, headers=sent)

    assert response.status_code == 401 and response.headers["content-type"] == "application/problem+json"
    assert response.json()["type"] == "/problems/rail-unauthenticated"
    await nothing_recorded(db, body["reference"])


@pytest.mark.parametrize("change", ["unknown reason code", "unknown type", "no amount", "not json"])
async def test_a_notification_the_rail_does_not_document_is_refused_not_guessed_at(change, http, stack, db, acme):
    _, body, created = await paid_out(http, stack, acme)
    payment = (await payments_for(db, body["reference"]))[0]
    message = notification(created["end_to_end_reference"], transfer_id=payment["rail_transfer_id"],
                           amount=payment["net_minor"], reason="ZZ99" if change == "unknown reason code" else "AC04")
    if change == "unknown type":
        message["type"] = "transfer.recalled"
    if change == "no amount":
        del message["data"]["amount"]
    content, sent = signed(message)
    if change == "not json":
        text = "{not json"
        content = text.encode()
        sent["webhook-signature"] = Webhook(RAIL_SECRET).sign(message["id"], datetime.now(UTC), text)

    response = await http.post(stack.api + NOTIFICATIONS, content=content, headers=sent)

    assert response.status_code == 400, response.text
    assert response.json()["type"] == "/problems/invalid-notification"
    await nothing_recorded(db, body["reference"])


async def test_a_notification_of_a_transfer_we_never_made_is_a_break_and_acknowledged(http, stack, db):
    message = notification("E2ENOSUCHPAYMENT")
    content, sent = signed(message)

    response = await http.post(stack.api + NOTIFICATIONS, content=content, headers=sent)
    again = await http.post(stack.api + NOTIFICATIONS, content=content, headers=sent)

    assert response.status_code == 200 and response.json()["outcome"] == "unmatched"
    assert again.status_code == 200 and again.json()["outcome"] == "duplicate"
    [found] = await db.fetch("SELECT * FROM reconciliation_break")
    assert found["kind"] == "unmatched_return" and found["end_to_end_reference"] == "E2ENOSUCHPAYMENT"
    [message_row] = await db.fetch("SELECT * FROM rail_message")
    assert message_row["outcome"] == "unmatched" and message_row["duplicates"] == 1


async def test_a_second_return_of_a_returned_payout_is_a_break_not_a_second_refund(http, stack, db, acme):
    key, body, created = await paid_out(http, stack, acme)
    await return_payout(http, stack, created["end_to_end_reference"])
    await status_is(db, body["reference"], "refunded")
    payment = (await payments_for(db, body["reference"]))[0]
    content, sent = signed(notification(created["end_to_end_reference"], transfer_id=payment["rail_transfer_id"],
                                        amount=payment["net_minor"]))

    response = await http.post(stack.api + NOTIFICATIONS, content=content, headers=sent)

    assert response.status_code == 200 and response.json()["outcome"] == "unexpected"
    [found] = await db.fetch("SELECT * FROM reconciliation_break")
    assert found["kind"] == "unexpected_return" and found["payment_id"] == payment["id"]
    assert len(await refunds(db, body["reference"])) == 1
    await assert_returned_once(http, stack, db, acme, key, body, created)


async def test_a_return_line_we_were_never_notified_of_is_applied_by_reconciliation(
    http, stack, db, acme, processes
):
    key, body, created = await paid_out(http, stack, acme)
    # The rail's notifications go nowhere: only its statement tells us.
    (await http.put(stack.rail.url + "/_admin/notify", json={"url": None, "secret": None})).raise_for_status()
    await return_payout(http, stack, created["end_to_end_reference"])
    today = datetime.now(UTC).date().isoformat()
    statement = (await http.get(f"{stack.rail.url}/v1/statements/{today}")).json()
    assert [r["end_to_end_reference"] for r in statement["returns"]] == [created["end_to_end_reference"]]

    code, output = await processes.cli("reconcile", "--date", today)

    assert code == 0, output
    assert "returns_applied_from_statement" in output
    message = await assert_returned_once(http, stack, db, acme, key, body, created)
    assert message["source"] == "statement" and message["message_id"] is None

    # The notification arrives at last: the same inbox key, a duplicate, dropped.
    notify = {"url": stack.api + NOTIFICATIONS, "secret": RAIL_SECRET}
    (await http.put(stack.rail.url + "/_admin/notify", json=notify)).raise_for_status()

    async def delivered() -> bool:
        return (await notifications(http, stack))[0]["state"] == "delivered"

    await until(delivered, "the late notification to be delivered")
    message = await assert_returned_once(http, stack, db, acme, key, body, created)
    assert message["duplicates"] == 1
    assert len(await refunds(db, body["reference"])) == 1


async def test_the_rail_returns_an_accepted_transfer_once_and_books_it_as_a_return_line(http, stack, db, acme):
    _, body, created = await paid_out(http, stack, acme)
    (await http.put(stack.rail.url + "/_admin/notify", json={"url": None, "secret": None})).raise_for_status()
    e2e = created["end_to_end_reference"]

    returned = await return_payout(http, stack, e2e)
    again = await http.post(stack.rail.url + "/_admin/return", json={"end_to_end_reference": e2e, "reason_code": "AC01"})
    unknown = await http.post(stack.rail.url + "/_admin/return",
                              json={"end_to_end_reference": "E2ENOSUCH", "reason_code": "AC04"})

    assert again.status_code == 409 and again.json()["type"].endswith("/already-returned")
    assert unknown.status_code == 404
    today = datetime.now(UTC).date().isoformat()
    statement = (await http.get(f"{stack.rail.url}/v1/statements/{today}")).json()
    [line] = statement["returns"]
    assert line == {
        "return_id": returned["return_id"], "transfer_id": returned["transfer_id"], "end_to_end_reference": e2e,
        "amount": body["amount"] - created["fee"], "currency": "EUR", "reason_code": "AC04", "booking_date": today,
    }
    assert [e["end_to_end_reference"] for e in statement["entries"]] == [e2e], "the transfer stays booked too"
    [n] = await notifications(http, stack)
    assert n["state"] == "pending" and n["deliveries"] == [], "nowhere to deliver: held, not lost"
