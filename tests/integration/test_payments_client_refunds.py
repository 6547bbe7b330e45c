"""payments_client's refunds against the real stack: one key per refund, kept before the first attempt and
sent on every retry, a 409 in-progress waited out as Retry-After says, a 202 returned as pending, and the
service's refusals raised as their own types.

The client is synchronous (httpx.Client): each call runs in a thread, so the
test's event loop, and the API processes it talks to, are never blocked.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest

from payments_client import (
    DuplicateRefund, Event, PaymentNotRefundable, PaymentsClient, RefundExceedsPayment,
)
from tests.support import claimed, headers, key_row, payment_body

REFUNDS_ENDPOINT = "POST /v1/payments/{id}/refunds"


async def paid(http, stack, client, amount: int = 10_000, **body) -> dict:
    response = await http.post(f"{stack.api}/v1/payments", json=payment_body(amount=amount, **body),
                               headers=headers(client, str(uuid.uuid4())))
    assert response.status_code == 201, response.text
    return response.json()


def sdk(stack, client, store: Path, events: list[Event] | None = None) -> PaymentsClient:
    return PaymentsClient(stack.api, client.api_key, store=store, backoff_base=0.05, max_seconds=20,
                          on_event=(events.append if events is not None else None))


async def refund_keys(db, payment_id: str) -> list[str]:
    rows = await db.fetch("SELECT key FROM idempotency_key WHERE endpoint = $1 AND payment_id = $2 ORDER BY created_at",
                          REFUNDS_ENDPOINT, uuid.UUID(payment_id))
    return [r["key"] for r in rows]


async def test_a_refund_is_made_once_under_the_key_stored_before_its_first_attempt_and_read_back_typed(
    http, stack, db, acme, tmp_path
):
    store = tmp_path / "client.json"
    with sdk(stack, acme, store) as client:
        # The payment through the same client (its POST loop is the one refunds share).
        payment = await asyncio.to_thread(client.pay, "order-1", payment_body(amount=10_000))
        assert payment["status"] == "succeeded"
        refund = await asyncio.to_thread(client.create_refund, payment["id"], 2500, reference="rma-1", reason="returned")
        assert (refund.status, refund.amount, refund.reference, refund.reason) == ("succeeded", 2500, "rma-1", "returned")
        stored = json.loads(store.read_text())["operations"][client.refund_operation(payment["id"], "rma-1")]
        assert stored["state"] == "done" and await refund_keys(db, payment["id"]) == [stored["key"]]

        # Asked again: the stored answer, and nothing sent (still one key row, one refund).
        again = await asyncio.to_thread(client.create_refund, payment["id"], 2500, reference="rma-1", reason="returned")
        assert again.id == refund.id and await refund_keys(db, payment["id"]) == [stored["key"]]
        with pytest.raises(ValueError, match="different body"):
            await asyncio.to_thread(client.create_refund, payment["id"], 2600, reference="rma-1", reason="returned")

        rest = await asyncio.to_thread(client.create_refund, payment["id"], reference="rma-2")  # all that is left
        assert rest.amount == 7500 and rest.status == "succeeded"
        got = await asyncio.to_thread(client.get_refund, refund.id)
        assert got.raw == refund.raw
        first = await asyncio.to_thread(client.list_refunds, payment["id"], limit=1)
        assert [r.id for r in first.data] == [refund.id] and first.has_more and first.amount_refundable == 0
        everything = await asyncio.to_thread(lambda: [r.id for r in client.iter_refunds(payment["id"], limit=1)])
        assert everything == [refund.id, rest.id]


async def test_a_pending_refund_is_returned_as_pending_and_resumed_with_the_same_key(http, stack, db, acme, tmp_path):
    payment = await paid(http, stack, acme)
    (await http.put(stack.psp.url + "/_admin/faults", json={"faults": [
        {"action": "pending", "operation": "refund", "seconds": 0, "settles_as": "failed"}]})).raise_for_status()
    store = tmp_path / "client.json"
    events: list[Event] = []
    with sdk(stack, acme, store, events) as client:
        pending = await asyncio.to_thread(client.create_refund, payment["id"], 4000, reference="rma-1")
        assert pending.status == "pending" and not pending.final, "a 202 is returned as such, not polled"
        assert client.store.pending(), "and stays pending in the store, with its key"
        [key] = await refund_keys(db, payment["id"])
    # A restarted client (a new instance on the same store) sends the same key: the service asks the PSP again.
    with sdk(stack, acme, store, events) as client:
        failed = await asyncio.to_thread(client.create_refund, payment["id"], 4000, reference="rma-1")
        assert failed.id == pending.id and failed.status == "failed" and failed.failure is not None
        assert await refund_keys(db, payment["id"]) == [key]
        # A failed refund refunded nothing and freed its reference: asked again, a new refund under a new key.
        retried = await asyncio.to_thread(client.create_refund, payment["id"], 4000, reference="rma-1")
        assert retried.id != failed.id and retried.status == "succeeded"
        keys = await refund_keys(db, payment["id"])
        assert len(keys) == 2 and keys[0] == key
    assert [e.kind for e in events if e.kind in ("key-created", "key-reused", "pending", "done")] == [
        "key-created", "pending", "key-reused", "done", "key-created", "done"]


async def test_a_refund_in_progress_is_retried_with_the_same_key_after_retry_after(http, stack, db, acme, tmp_path):
    payment = await paid(http, stack, acme)
    # The PSP takes its time over the refund, so the first attempt still owns the key when the client arrives.
    (await http.put(stack.psp.url + "/_admin/faults", json={"faults": [
        {"action": "delay", "operation": "refund", "seconds": 1.5}]})).raise_for_status()
    key = str(uuid.uuid4())
    body = {"amount": 1000, "reference": "rma-1"}
    first = asyncio.create_task(http.post(f"{stack.api}/v1/payments/{payment['id']}/refunds", json=body,
                                          headers=headers(acme, key)))
    await claimed(db, acme.id, key)
    events: list[Event] = []
    with sdk(stack, acme, tmp_path / "client.json", events) as client:
        refund = await asyncio.to_thread(client.create_refund, payment["id"], 1000, reference="rma-1",
                                         idempotency_key=key)
    assert (await first).status_code == 201
    responses = [e for e in events if e.kind == "response"]
    assert responses[0].status == 409 and responses[0].problem == "request-in-progress"
    waits = [e.seconds for e in events if e.kind == "wait"]
    assert waits and waits[0] == responses[0].retry_after, "the wait is the server's Retry-After"
    assert responses[-1].status == 201 and responses[-1].replayed and refund.status == "succeeded"
    assert {e.key for e in events} == {key} and (await key_row(db, acme.id, key))["state"] == "finished"


async def test_the_services_refusals_are_raised_as_their_own_types(http, stack, db, acme, tmp_path):
    payment = await paid(http, stack, acme)
    with sdk(stack, acme, tmp_path / "one.json") as client:
        made = await asyncio.to_thread(client.create_refund, payment["id"], 1000, reference="rma-1")
        with pytest.raises(RefundExceedsPayment) as exceeds:
            await asyncio.to_thread(client.create_refund, payment["id"], 9500, reference="rma-2")
        assert exceeds.value.status == 409 and exceeds.value.amount_refundable == 9000
    # Another process, with a store of its own, asks for the same refund under a key of its own.
    with sdk(stack, acme, tmp_path / "two.json") as other:
        with pytest.raises(DuplicateRefund) as duplicate:
            await asyncio.to_thread(other.create_refund, payment["id"], 1000, reference="rma-1")
        assert duplicate.value.refund_id == made.id
        declined = await paid(http, stack, acme, card_token="tok_decline")
        assert declined["status"] == "declined"
        with pytest.raises(PaymentNotRefundable) as not_refundable:
            await asyncio.to_thread(other.create_refund, declined["id"], reference="rma-1")
        assert not_refundable.value.payment_status == "declined"
    assert await db.fetchval("SELECT refunded_minor FROM payment WHERE id = $1", uuid.UUID(payment["id"])) == 1000
