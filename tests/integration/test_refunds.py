"""Client refunds through the API: the response matrix, keys scoped by endpoint, business identity, the balance.

Real processes: two API processes, the fake PSP and the fake rail. The
evidence is durable state: the refund rows and the payment's refunded
amount, the key rows, the ledger, the events, and the PSP's own refunds.
"""

from __future__ import annotations

import json
import uuid

import pytest

from tests.support import event_types, headers, key_row, ledger, payment_body, unbalanced_payments


async def paid(http, stack, client, amount: int = 10_000) -> dict:
    response = await http.post(
        f"{stack.api}/v1/payments", json=payment_body(amount=amount), headers=headers(client, str(uuid.uuid4()))
    )
    assert response.status_code == 201 and response.json()["status"] == "succeeded", response.text
    return response.json()


async def refund(http, api: str, client, payment_id: str, body: dict, key: str | None = None):
    return await http.post(
        f"{api}/v1/payments/{payment_id}/refunds", json=body, headers=headers(client, key or str(uuid.uuid4()))
    )


async def psp_refunds_of(db, payment) -> list:
    """The PSP's own refunds of this payment's charge, made for client refunds (not compensations)."""
    charge_id = await db.fetchval("SELECT psp_charge_id FROM payment WHERE id = $1", uuid.UUID(payment["id"]))
    return await db.fetch("SELECT * FROM fake_psp.refund WHERE charge_id = $1 ORDER BY created_at", charge_id)


async def test_a_partial_refund_is_refunded_once_posted_and_replayed_byte_for_byte(http, stack, db, acme):
    payment = await paid(http, stack, acme)
    key = str(uuid.uuid4())
    body = {"amount": 2500, "reference": "rma-1", "reason": "one item returned"}
    first = await refund(http, stack.api, acme, payment["id"], body, key)
    assert first.status_code == 201, first.text
    created = first.json()
    assert created["status"] == "succeeded" and created["amount"] == 2500 and created["object"] == "refund"
    assert created["payment_id"] == payment["id"] and created["reason"] == "one item returned"

    # A retry on the other API process: the stored bytes, and no second refund at the PSP.
    again = await refund(http, stack.apis[1].url, acme, payment["id"], body, key)
    assert again.status_code == 201 and again.content == first.content
    assert again.headers["Idempotent-Replayed"] == "true"
    [at_psp] = await psp_refunds_of(db, payment)
    assert at_psp["amount"] == 2500

    pid = uuid.UUID(payment["id"])
    assert await db.fetchval("SELECT refunded_minor FROM payment WHERE id = $1", pid) == 2500
    posting = f"refund:{created['id']}"
    assert [e for e in await ledger(db, pid) if e[0] == posting] == [
        (posting, "client_receivable", 2500, 0), (posting, "psp_receivable", 0, 2500),
    ]
    assert await unbalanced_payments(db) == []
    assert (await event_types(db, pid))[-1] == "refund.succeeded"

    got = await http.get(f"{stack.api}/v1/refunds/{created['id']}", headers=acme.auth)
    assert got.status_code == 200 and got.json() == created
    listed = await http.get(f"{stack.api}/v1/payments/{payment['id']}/refunds", headers=acme.auth)
    assert listed.json()["data"] == [created] and listed.json()["amount_refundable"] == 10_000 - 2500


async def test_a_full_refund_takes_what_is_left_and_a_second_one_finds_nothing(http, stack, db, acme):
    payment = await paid(http, stack, acme)
    assert (await refund(http, stack.api, acme, payment["id"], {"amount": 3000, "reference": "part"})).status_code == 201
    full = await refund(http, stack.api, acme, payment["id"], {"reference": "rest"})
    assert full.status_code == 201 and full.json()["amount"] == 7000, full.text

    key = str(uuid.uuid4())
    nothing = await refund(http, stack.api, acme, payment["id"], {"reference": "more"}, key)
    assert nothing.status_code == 409 and nothing.headers["content-type"] == "application/problem+json"
    assert nothing.json()["type"] == "/problems/refund-exceeds-payment"
    assert nothing.json()["amount_refundable"] == 0
    # The refusal is that key's stored result, replayed like a decline.
    replay = await refund(http, stack.apis[1].url, acme, payment["id"], {"reference": "more"}, key)
    assert replay.status_code == 409 and replay.content == nothing.content
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert (await key_row(db, acme.id, key))["state"] == "finished"
    assert sum(r["amount"] for r in await psp_refunds_of(db, payment)) == 10_000
    assert await db.fetchval("SELECT count(*) FROM refund WHERE payment_id = $1", uuid.UUID(payment["id"])) == 2


async def test_a_refund_larger_than_what_is_left_is_refused_and_refunds_nothing(http, stack, db, acme):
    payment = await paid(http, stack, acme)
    too_much = await refund(http, stack.api, acme, payment["id"], {"amount": 10_001, "reference": "big"})
    assert too_much.status_code == 409 and too_much.json()["type"] == "/problems/refund-exceeds-payment"
    assert too_much.json()["amount_refundable"] == 10_000
    assert await psp_refunds_of(db, payment) == []
    assert await db.fetchval("SELECT refunded_minor FROM payment WHERE id = $1", uuid.UUID(payment["id"])) == 0


async def test_the_same_reference_under_another_key_is_a_duplicate_and_refunds_nothing_more(http, stack, db, acme):
    payment = await paid(http, stack, acme)
    body = {"amount": 1000, "reference": "cancel-1"}
    first = await refund(http, stack.api, acme, payment["id"], body)
    assert first.status_code == 201
    for second_body in (body, {"amount": 500, "reference": "cancel-1"}):  # the double click; another amount
        key = str(uuid.uuid4())
        second = await refund(http, stack.apis[1].url, acme, payment["id"], second_body, key)
        assert second.status_code == 409 and second.json()["type"] == "/problems/duplicate-refund", second.text
        assert second.json()["refund_id"] == first.json()["id"]
        assert await key_row(db, acme.id, key) is None, "nothing stored: the claim rolled back"
    assert [r["amount"] for r in await psp_refunds_of(db, payment)] == [1000]
    assert await db.fetchval("SELECT refunded_minor FROM payment WHERE id = $1", uuid.UUID(payment["id"])) == 1000


async def test_a_key_is_scoped_by_its_endpoint_payment_keys_and_refund_keys_never_replay_each_other(
    http, stack, db, acme
):
    pay_key = str(uuid.uuid4())
    created = await http.post(f"{stack.api}/v1/payments", json=payment_body(), headers=headers(acme, pay_key))
    assert created.status_code == 201
    payment = created.json()
    # The payment's key, presented to the refund endpoint: 422, nothing refunded.
    reused = await refund(http, stack.api, acme, payment["id"], {"amount": 100, "reference": "r"}, pay_key)
    assert reused.status_code == 422 and reused.json()["type"] == "/problems/idempotency-key-reused"
    assert await psp_refunds_of(db, payment) == []
    # A refund's key, presented to the payment endpoint: 422, no payment made.
    refund_key = str(uuid.uuid4())
    assert (await refund(http, stack.api, acme, payment["id"], {"amount": 100, "reference": "r"}, refund_key)).status_code == 201
    as_payment = await http.post(f"{stack.api}/v1/payments", json=payment_body(), headers=headers(acme, refund_key))
    assert as_payment.status_code == 422 and as_payment.json()["type"] == "/problems/idempotency-key-reused"
    assert (await key_row(db, acme.id, refund_key))["endpoint"] == "POST /v1/payments/{id}/refunds"
    # The same refund key for another payment's refund: another request, 422.
    other = await paid(http, stack, acme)
    again = await refund(http, stack.api, acme, other["id"], {"amount": 100, "reference": "r"}, refund_key)
    assert again.status_code == 422
    assert await psp_refunds_of(db, other) == []


async def test_another_clients_payment_is_not_found_and_its_refunds_are_not_listed(http, stack, db, acme, globex):
    payment = await paid(http, stack, acme)
    made = await refund(http, stack.api, acme, payment["id"], {"amount": 100, "reference": "r"})
    theirs = await refund(http, stack.api, globex, payment["id"], {"amount": 100, "reference": "x"})
    assert theirs.status_code == 404 and theirs.json()["type"] == "/problems/not-found"
    listed = await http.get(f"{stack.api}/v1/payments/{payment['id']}/refunds", headers=globex.auth)
    assert listed.status_code == 404
    got = await http.get(f"{stack.api}/v1/refunds/{made.json()['id']}", headers=globex.auth)
    assert got.status_code == 404
    unauthenticated = await http.post(f"{stack.api}/v1/payments/{payment['id']}/refunds", json={"reference": "r"},
                                      headers={"Idempotency-Key": "k"})
    assert unauthenticated.status_code == 401
    missing = await refund(http, stack.api, acme, str(uuid.uuid4()), {"reference": "r"})
    assert missing.status_code == 404
    assert (await refund(http, stack.api, acme, "not-a-uuid", {"reference": "r"})).status_code == 404
    assert [r["amount"] for r in await psp_refunds_of(db, payment)] == [100]


async def test_a_declined_payment_is_not_refundable_and_nothing_is_stored(http, stack, db, acme):
    key = str(uuid.uuid4())
    declined = await http.post(f"{stack.api}/v1/payments", json=payment_body(card_token="tok_decline"),
                               headers=headers(acme, str(uuid.uuid4())))
    assert declined.json()["status"] == "declined"
    answer = await refund(http, stack.api, acme, declined.json()["id"], {"reference": "r"}, key)
    assert answer.status_code == 409 and answer.json()["type"] == "/problems/payment-not-refundable"
    assert answer.json()["status"] == 409 and answer.json()["payment_status"] == "declined"
    assert await key_row(db, acme.id, key) is None


@pytest.mark.parametrize("body", [{"amount": 0, "reference": "r"}, {"amount": "100", "reference": "r"},
                                  {"amount": 100}, {"amount": 100, "reference": "r", "extra": 1}])
async def test_a_malformed_refund_is_a_400_and_stores_nothing(http, stack, db, acme, body):
    payment = await paid(http, stack, acme)
    key = str(uuid.uuid4())
    answer = await refund(http, stack.api, acme, payment["id"], body, key)
    assert answer.status_code == 400 and answer.json()["type"] == "/problems/invalid-request"
    assert await key_row(db, acme.id, key) is None


async def test_a_payments_refunds_are_listed_oldest_first_page_by_page(http, stack, acme):
    payment = await paid(http, stack, acme)
    made = [(await refund(http, stack.api, acme, payment["id"], {"amount": 100, "reference": f"r{i}"})).json()["id"]
            for i in range(5)]
    seen, after = [], None
    while True:
        params = {"limit": 2} | ({"after": after} if after else {})
        page = (await http.get(f"{stack.api}/v1/payments/{payment['id']}/refunds", params=params,
                               headers=acme.auth)).json()
        seen += [r["id"] for r in page["data"]]
        after = page["next_after"]
        if not page["has_more"]:
            break
    assert seen == made and page["amount_refundable"] == 10_000 - 500


async def test_a_refund_the_psp_fails_gives_its_amount_back_once(http, stack, db, acme):
    payment = await paid(http, stack, acme)
    fault = {"action": "pending", "operation": "refund", "seconds": 0, "settles_as": "failed"}
    (await http.put(stack.psp.url + "/_admin/faults", json={"faults": [fault]})).raise_for_status()
    key = str(uuid.uuid4())
    first = await refund(http, stack.api, acme, payment["id"], {"reference": "all"}, key)
    # Pending at the PSP at first: 202. The retry probes, finds it failed, records it.
    assert first.status_code == 202 and first.json()["status"] == "pending", first.text
    final = await refund(http, stack.api, acme, payment["id"], {"reference": "all"}, key)
    assert final.status_code == 201 and final.json()["status"] == "failed", final.text
    pid = uuid.UUID(payment["id"])
    assert await db.fetchval("SELECT refunded_minor FROM payment WHERE id = $1", pid) == 0
    assert [e for e in await ledger(db, pid) if e[0].startswith("refund:")] == []
    # Its amount is refundable again, and its reference free: a new key takes all of it.
    again = await refund(http, stack.api, acme, payment["id"], {"reference": "all"})
    assert again.status_code == 201 and again.json()["status"] == "succeeded" and again.json()["amount"] == 10_000
    assert await db.fetchval("SELECT refunded_minor FROM payment WHERE id = $1", pid) == 10_000
    types = await event_types(db, pid)
    assert types.count("refund.failed") == 1 and types.count("refund.succeeded") == 1
    assert json.loads((await db.fetchval(
        "SELECT data::text FROM event WHERE payment_id = $1 AND type = 'refund.failed'", pid)))["status"] == "failed"
