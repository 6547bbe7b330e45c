"""Webhooks on real processes: a dispatcher killed mid-delivery, a merchant that fails after applying,
two dispatchers at once, bad signatures, the give-up and a person's redelivery.

The system under test: the session's API processes (which write events and
deliveries with each payment), `payments worker` processes started per test
(whose dispatcher delivers them), and the fake merchant, which verifies each
POST and applies it once through its inbox. The evidence is durable: our
delivery and attempt rows, and the merchant's own records (its inbox, its
payment rows with how many events it applied, its log of every POST it
received and when it answered it).
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from standardwebhooks import Webhook

from app.outbox.endpoints import new_secret
from app.outbox.sealing import SecretsKey
from tests.conftest import SECRETS_KEY
from tests.support import headers, payment_body, until

pytestmark = pytest.mark.usefixtures("stack")

# Short enough for a test, long enough for a loaded 2-core machine: a POST
# may take 1 s, a claim lasts 3 s, retries come 0.1-0.4 s apart.
FAST = {
    "WORKER_POLL_SECONDS": "0.1",
    "WEBHOOK_POLL_SECONDS": "0.1",
    "WEBHOOK_TIMEOUT_SECONDS": "1",
    "WEBHOOK_LEASE_SECONDS": "3",
    "WEBHOOK_BACKOFF_BASE_SECONDS": "0.1",
    "WEBHOOK_BACKOFF_CAP_SECONDS": "0.4",
}


async def pay(http, stack, shop, db) -> tuple[dict, uuid.UUID]:
    """A payment by the shop; its answer and its one event's id."""
    body = payment_body()
    response = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(shop, str(uuid.uuid4())))
    assert response.status_code == 201, response.text
    event_id = await db.fetchval("SELECT id FROM event WHERE payment_id = $1", uuid.UUID(response.json()["id"]))
    return response.json(), event_id


async def delivery(db, event_id) -> dict | None:
    """The event's delivery row; None before its first attempt has been written."""
    row = await db.fetchrow("SELECT * FROM webhook_delivery WHERE event_id = $1", event_id)
    return None if row is None else dict(row)


async def attempts(db, event_id) -> list[dict]:
    return [dict(r) for r in await db.fetch("SELECT * FROM webhook_attempt WHERE event_id = $1 ORDER BY attempt", event_id)]


async def received(db, event_id) -> list[dict]:
    rows = await db.fetch("SELECT * FROM fake_merchant.received WHERE webhook_id = $1 ORDER BY seq", str(event_id))
    return [dict(r) for r in rows]


async def inbox(db, event_id) -> int:
    return await db.fetchval("SELECT count(*) FROM fake_merchant.processed_message WHERE webhook_id = $1", str(event_id))


async def merchant_payment(db, payment_id) -> dict | None:
    row = await db.fetchrow("SELECT * FROM fake_merchant.payment WHERE payment_id = $1", payment_id)
    return None if row is None else dict(row)


async def in_state(db, event_id, state: str, timeout: float = 30.0) -> None:
    async def reached() -> bool:
        row = await delivery(db, event_id)
        return row is not None and row["state"] == state

    await until(reached, f"delivery of {event_id} to be {state}", timeout)


async def set_merchant_faults(http, merchant, *faults) -> None:
    (await http.put(merchant.url + "/_admin/faults", json={"faults": list(faults)})).raise_for_status()


async def assert_applied_once(db, payment: dict, event_id) -> None:
    assert await inbox(db, event_id) == 1, "one row in the merchant's inbox"
    applied = await merchant_payment(db, payment["id"])
    assert applied is not None and applied["events_applied"] == 1, "the effect happened once"
    assert applied["status"] == payment["status"] and applied["last_event_id"] == str(event_id)


async def test_a_delivery_is_signed_posted_once_and_recorded(http, stack, db, shop, merchant, processes):
    payment, event_id = await pay(http, stack, shop, db)
    assert await delivery(db, event_id) is None, "no row is written for a webhook before its first attempt"

    processes.worker(**FAST)
    await in_state(db, event_id, "delivered")

    await assert_applied_once(db, payment, event_id)
    [got] = await received(db, event_id)
    assert got["status_code"] == 200 and got["outcome"] == "applied"
    [attempt] = await attempts(db, event_id)
    assert attempt["outcome"] == "delivered" and attempt["status_code"] == 200
    assert attempt["latency_ms"] > 0 and attempt["error_class"] is None and attempt["url"] == shop.webhook_url


async def test_a_caught_up_dispatcher_reads_again_after_its_own_poll_not_the_sweeps(
    http, stack, db, shop, merchant, processes
):
    # The recovery sweep rests a minute here. The cursor has its own rest
    # (WEBHOOK_POLL_SECONDS); were it the sweep's, the second webhook would
    # wait that minute behind the first one's read.
    processes.worker(**{**FAST, "WORKER_POLL_SECONDS": "60"})
    _, first = await pay(http, stack, shop, db)
    await in_state(db, first, "delivered")  # read alone, so its batch was not full: the dispatcher rests
    payment, second = await pay(http, stack, shop, db)
    await in_state(db, second, "delivered", timeout=20)
    await assert_applied_once(db, payment, second)


@pytest.mark.parametrize("point", ["webhook-after-delivery", "webhook-after-claim"])
async def test_a_dispatcher_killed_mid_delivery_is_followed_by_a_redelivery_applied_once(
    point, http, stack, db, shop, merchant, processes
):
    payment, event_id = await pay(http, stack, shop, db)

    doomed = processes.worker("doomed", PAYMENTS_CRASH_AT=point, **FAST)
    assert doomed.wait(30) == 137, "the dispatcher died at the crash point"
    # A first attempt writes nothing until its batch moves the cursor: the
    # dead dispatcher left the cursor leased, unmoved, and no row.
    assert await delivery(db, event_id) is None and await attempts(db, event_id) == []
    cursor = await db.fetchrow("SELECT event_id, lease_expires_at > now() AS leased FROM webhook_cursor")
    assert tuple(cursor) == (uuid.UUID(int=0), True)
    if point == "webhook-after-delivery":
        await assert_applied_once(db, payment, event_id)  # the merchant applied it; we never learned so
    else:
        assert await received(db, event_id) == [], "nothing was POSTed"

    processes.worker("next", **FAST)
    await in_state(db, event_id, "delivered")

    await assert_applied_once(db, payment, event_id)
    outcomes = [r["outcome"] for r in await received(db, event_id)]
    assert outcomes == (["applied", "duplicate"] if point == "webhook-after-delivery" else ["applied"])
    # The next dispatcher read the batch again once the lease ran out; its
    # attempt is the first of ours on record (the merchant's log has both).
    assert [(a["attempt"], a["outcome"]) for a in await attempts(db, event_id)] == [(1, "delivered")]


async def test_a_merchant_that_fails_after_applying_is_retried_and_applies_once(
    http, stack, db, shop, merchant, processes
):
    await set_merchant_faults(http, merchant, {"action": "error_after", "status": 500})
    payment, event_id = await pay(http, stack, shop, db)

    processes.worker(**FAST)
    await in_state(db, event_id, "delivered")

    await assert_applied_once(db, payment, event_id)
    assert [(r["status_code"], r["outcome"]) for r in await received(db, event_id)] == [
        (500, "fault"), (200, "duplicate"),
    ], "applied, answered 500, redelivered and dropped"
    assert [(a["outcome"], a["status_code"], a["error_class"]) for a in await attempts(db, event_id)] == [
        ("retry", 500, "http_status"), ("delivered", 200, None),
    ]


async def test_two_dispatchers_deliver_each_event_once_and_never_at_the_same_time(
    http, stack, db, shop, merchant, processes
):
    # The merchant is slow, so both dispatchers have deliveries in flight at once.
    await set_merchant_faults(http, merchant, {"action": "delay", "seconds": 0.2, "times": None})
    paid = [await pay(http, stack, shop, db) for _ in range(12)]

    processes.worker("worker-1", **FAST)
    processes.worker("worker-2", **FAST)

    async def all_delivered() -> bool:
        return await db.fetchval("SELECT count(*) FROM webhook_delivery WHERE state = 'delivered'") == len(paid)

    await until(all_delivered, "every delivery to be delivered", timeout=60)
    for payment, event_id in paid:
        await assert_applied_once(db, payment, event_id)
        [got] = await received(db, event_id)
        assert got["outcome"] == "applied", "each event POSTed exactly once: no concurrent double delivery"
        assert [a["outcome"] for a in await attempts(db, event_id)] == ["delivered"]


async def test_a_bad_signature_is_refused_with_401_nothing_applied_and_redelivered_once_fixed(
    http, stack, db, shop, merchant, processes
):
    (await http.put(merchant.url + "/_admin/secrets", json={"secrets": [new_secret()]})).raise_for_status()
    payment, event_id = await pay(http, stack, shop, db)
    processes.worker(**FAST)

    async def refused_twice() -> bool:
        return sum(1 for a in await attempts(db, event_id) if a["status_code"] == 401) >= 2

    await until(refused_twice, "two attempts refused with 401")
    assert await inbox(db, event_id) == 0 and await merchant_payment(db, payment["id"]) is None, "nothing applied"
    assert all(r["outcome"] == "rejected" for r in await received(db, event_id))
    assert (await delivery(db, event_id))["state"] == "pending", "a 401 is retried: the endpoint may be fixed"

    (await http.post(merchant.url + "/_admin/secrets", json={"secret": shop.secret})).raise_for_status()
    await in_state(db, event_id, "delivered")
    await assert_applied_once(db, payment, event_id)


@pytest.mark.parametrize("skew", [timedelta(minutes=-6), timedelta(minutes=6)])
async def test_a_stale_or_future_signature_is_refused_and_nothing_applied(skew, http, stack, db, shop, merchant):
    payment, event_id = await pay(http, stack, shop, db)
    body = json.dumps({"type": "payment.succeeded", "timestamp": "2026-01-01T00:00:00Z", "data": payment})
    when = datetime.now(UTC) + skew
    signed = {
        "webhook-id": str(event_id),
        "webhook-timestamp": str(int(when.timestamp())),
        "webhook-signature": Webhook(shop.secret).sign(str(event_id), when, body),
    }

    response = await http.post(shop.webhook_url, content=body, headers=signed)

    assert response.status_code == 401
    assert await inbox(db, event_id) == 0 and await merchant_payment(db, payment["id"]) is None
    # The same body signed now is accepted: only the time was wrong.
    now = datetime.now(UTC)
    signed |= {"webhook-timestamp": str(int(now.timestamp())),
               "webhook-signature": Webhook(shop.secret).sign(str(event_id), now, body)}
    assert (await http.post(shop.webhook_url, content=body, headers=signed)).status_code == 200
    assert await inbox(db, event_id) == 1


async def test_a_delivery_given_up_after_the_schedule_is_dead_until_a_person_redelivers_it(
    http, stack, db, shop, merchant, processes
):
    await set_merchant_faults(http, merchant, {"action": "error_before", "status": 503, "times": None})
    payment, event_id = await pay(http, stack, shop, db)

    processes.worker(WEBHOOK_MAX_ATTEMPTS="3", **FAST)
    await in_state(db, event_id, "dead")

    tried = await attempts(db, event_id)
    assert [(a["outcome"], a["status_code"]) for a in tried] == [("retry", 503), ("retry", 503), ("dead", 503)]
    assert await inbox(db, event_id) == 0
    assert len(await received(db, event_id)) == 3, "nothing retries a dead delivery"
    code, output = await processes.cli("events", "list", "--state", "dead")
    assert code == 0 and str(event_id) in output, output

    (await http.delete(merchant.url + "/_admin/faults")).raise_for_status()
    code, output = await processes.cli("events", "redeliver", str(event_id))
    assert code == 0 and "queued" in output, output

    await in_state(db, event_id, "delivered")
    await assert_applied_once(db, payment, event_id)
    assert [a["outcome"] for a in await attempts(db, event_id)] == ["retry", "retry", "dead", "delivered"]


async def test_a_429_is_retried_after_its_retry_after(http, stack, db, shop, merchant, processes):
    await set_merchant_faults(http, merchant, {"action": "rate_limit", "seconds": 1})
    payment, event_id = await pay(http, stack, shop, db)

    processes.worker(**(FAST | {"WEBHOOK_BACKOFF_CAP_SECONDS": "5"}))
    await in_state(db, event_id, "delivered")

    first, second = await attempts(db, event_id)
    assert (first["status_code"], first["error_class"]) == (429, "rate_limited")
    waited = (second["started_at"] - first["finished_at"]).total_seconds()
    assert waited >= 0.9, f"Retry-After: 1 honoured (waited {waited:.2f} s, the backoff alone is 0.05-0.1 s)"
    await assert_applied_once(db, payment, event_id)


async def test_a_merchant_that_hangs_is_timed_out_and_retried_and_applies_once(
    http, stack, db, shop, merchant, processes
):
    await set_merchant_faults(http, merchant, {"action": "hang_after", "seconds": 2})
    payment, event_id = await pay(http, stack, shop, db)

    processes.worker(**FAST)
    await in_state(db, event_id, "delivered")

    first = (await attempts(db, event_id))[0]
    assert first["error_class"] == "timeout" and first["status_code"] is None
    await assert_applied_once(db, payment, event_id)


async def test_removing_the_endpoint_cancels_pending_deliveries_and_keeps_the_events(
    http, stack, db, shop, merchant, processes
):
    _, event_id = await pay(http, stack, shop, db)

    code, output = await processes.cli("clients", "remove-webhook", "shop")

    assert code == 0 and "1 pending deliveries cancelled" in output, output
    assert (await delivery(db, event_id))["state"] == "cancelled"
    assert await db.fetchval("SELECT count(*) FROM event WHERE id = $1", event_id) == 1


async def test_the_cli_creates_a_client_with_a_webhook_and_shows_its_secret_once(http, stack, db, merchant, processes):
    url = merchant.url + "/webhooks"
    code, output = await processes.cli("clients", "create", "cli-shop", "--webhook-url", url)
    assert code == 0, output
    secret = next(word for word in output.split() if word.startswith("whsec_"))
    stored = await db.fetchrow(
        "SELECT w.url, w.secret_sealed FROM webhook_endpoint w JOIN client c ON c.id = w.client_id "
        "WHERE c.name = 'cli-shop'"
    )
    # Stored sealed (docs/outbox-inbox.md#signing-secrets-at-rest): it opens to the secret shown.
    assert (stored["url"], SecretsKey(SECRETS_KEY).open(stored["secret_sealed"])) == (url, secret)

    code, output = await processes.cli("clients", "set-webhook", "cli-shop", url + "/v2")
    assert code == 0 and "whsec_" not in output and "unchanged" in output, output
    code, output = await processes.cli("clients", "set-webhook", "cli-shop", "ftp://nope")
    assert code == 2, output
    assert (await db.fetchval("SELECT url FROM webhook_endpoint WHERE secret_sealed = $1",
                              stored["secret_sealed"])) == url + "/v2", "the secret unchanged, the URL changed"


async def test_a_worker_survives_without_its_merchant(http, stack, db, shop, processes):
    await db.execute("UPDATE webhook_endpoint SET url = 'http://127.0.0.1:9/webhooks' WHERE client_id = $1", shop.id)
    _, event_id = await pay(http, stack, shop, db)

    worker = processes.worker(**FAST)

    async def refused() -> bool:
        return any(a["error_class"] == "connection" for a in await attempts(db, event_id))

    await until(refused, "an attempt refused at connect")
    assert (await delivery(db, event_id))["state"] == "pending", "retried later, not lost"
    assert worker.poll() is None, "the worker is still running"


async def test_a_refunds_event_is_signed_and_delivered_to_the_merchant_once(http, stack, db, shop, merchant, processes):
    payment, _ = await pay(http, stack, shop, db)
    answer = await http.post(f"{stack.api}/v1/payments/{payment['id']}/refunds",
                             json={"amount": 300, "reference": "rma-hook"}, headers=headers(shop, str(uuid.uuid4())))
    assert answer.status_code == 201, answer.text
    event_id = await db.fetchval("SELECT id FROM event WHERE payment_id = $1 AND type = 'refund.succeeded'",
                                 uuid.UUID(payment["id"]))

    processes.worker(**FAST)
    await in_state(db, event_id, "delivered")

    [got] = await received(db, event_id)
    assert got["status_code"] == 200 and got["outcome"] == "applied"
    assert await inbox(db, event_id) == 1
    # The merchant applied it under its type; the event carries the refund as the API answered it.
    assert await db.fetchval("SELECT type FROM fake_merchant.processed_message WHERE webhook_id = $1",
                             str(event_id)) == "refund.succeeded"
    assert json.loads(await db.fetchval("SELECT data::text FROM event WHERE id = $1", event_id)) == answer.json()
