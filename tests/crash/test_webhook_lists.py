"""Several events in one POST, on real processes: an endpoint that asked for lists, a list the merchant
fails after applying, a dispatcher killed after the list was sent, and the command that sets it.

The system under test is the one of tests/crash/test_webhook_delivery.py:
the session's API processes, `payments worker` processes started per test,
and the fake merchant, which verifies each POST and applies every event it
carries once through its inbox. The evidence is durable: our delivery and
attempt rows, and the merchant's own records (its log of every POST, with
how many events each carried, its inbox, and its payment rows with how many
events it applied).
"""

from __future__ import annotations

import pytest

from tests.crash.test_webhook_delivery import (
    FAST, assert_applied_once, attempts, in_state, pay, received, set_merchant_faults,
)
from tests.support import behind_every_running_transaction, until

pytestmark = pytest.mark.usefixtures("stack")


async def takes_lists(db, shop, events_per_post: int) -> None:
    await db.execute("UPDATE webhook_endpoint SET events_per_post = $2 WHERE client_id = $1", shop.id, events_per_post)


async def waiting(http, stack, db, shop, count: int) -> list:
    """`count` payments of the shop, their events readable behind the cursor before any dispatcher runs (a
    transaction still open on the server, another test's too, holds them back): one read finds them all."""
    paid = [await pay(http, stack, shop, db) for _ in range(count)]
    await behind_every_running_transaction(db)
    return paid


async def posts(db) -> list[dict]:
    """Every POST the merchant received, in order."""
    return [dict(r) for r in await db.fetch("SELECT * FROM fake_merchant.received ORDER BY seq")]


async def all_delivered(db, paid: list) -> None:
    async def delivered() -> bool:
        return await db.fetchval("SELECT count(*) FROM webhook_delivery WHERE state = 'delivered'") == len(paid)

    await until(delivered, "every delivery to be delivered", timeout=60)


async def test_waiting_events_go_in_lists_of_the_endpoints_size_each_signed_and_applied_once(
    http, stack, db, shop, merchant, processes
):
    await takes_lists(db, shop, 5)
    paid = await waiting(http, stack, db, shop, 7)

    processes.worker(**FAST)
    await all_delivered(db, paid)

    got = await posts(db)
    # The two lists are POSTed at once, so either may arrive first.
    assert sorted((p["events"], p["status_code"], p["outcome"]) for p in got) == [
        (2, 200, "applied"), (5, 200, "applied")], "two signed POSTs (a bad signature is a 401), five events and two"
    assert all(p["webhook_id"].startswith("list_") for p in got)
    for payment, event_id in paid:
        await assert_applied_once(db, payment, event_id)
        assert [(a["attempt"], a["outcome"], a["status_code"]) for a in await attempts(db, event_id)] == [
            (1, "delivered", 200)], "each event's own attempt row, the list's answer"


async def test_an_endpoint_that_asked_for_one_event_a_post_gets_one(http, stack, db, shop, merchant, processes):
    paid = [await pay(http, stack, shop, db) for _ in range(3)]

    processes.worker(**FAST)
    await all_delivered(db, paid)

    got = await posts(db)
    assert [p["events"] for p in got] == [1, 1, 1]
    assert sorted(p["webhook_id"] for p in got) == sorted(str(event_id) for _, event_id in paid), \
        "the Standard Webhooks message: the event's own id"


async def test_a_list_the_merchant_fails_after_applying_is_retried_event_by_event_and_each_applies_once(
    http, stack, db, shop, merchant, processes
):
    await takes_lists(db, shop, 10)
    await set_merchant_faults(http, merchant, {"action": "error_after", "status": 500})
    paid = await waiting(http, stack, db, shop, 3)

    processes.worker(**FAST)
    await all_delivered(db, paid)

    [listed, *alone] = await posts(db)
    assert (listed["events"], listed["status_code"], listed["outcome"]) == (3, 500, "fault"), \
        "applied all three, then answered 500"
    assert sorted((p["webhook_id"], p["events"], p["outcome"]) for p in alone) == sorted(
        (str(event_id), 1, "duplicate") for _, event_id in paid), "each retried alone, and dropped by the inbox"
    for payment, event_id in paid:
        await assert_applied_once(db, payment, event_id)
        assert [(a["outcome"], a["status_code"]) for a in await attempts(db, event_id)] == [
            ("retry", 500), ("delivered", 200)]


async def test_a_dispatcher_killed_after_posting_a_list_is_followed_by_the_same_list_applied_once(
    http, stack, db, shop, merchant, processes
):
    await takes_lists(db, shop, 10)
    paid = await waiting(http, stack, db, shop, 3)  # each dispatcher's one read finds all three

    doomed = processes.worker("doomed", PAYMENTS_CRASH_AT="webhook-after-delivery", **FAST)
    assert doomed.wait(30) == 137, "the dispatcher died after the merchant answered the list"
    assert await db.fetchval("SELECT count(*) FROM webhook_delivery") == 0, "nothing of the batch was written"

    processes.worker("next", **FAST)
    await all_delivered(db, paid)

    got = await posts(db)
    assert [(p["events"], p["outcome"]) for p in got] == [(3, "applied"), (3, "duplicate")]
    assert got[0]["webhook_id"] == got[1]["webhook_id"], "the same events in the same order: the same message id"
    for payment, event_id in paid:
        await assert_applied_once(db, payment, event_id)
        assert [(a["attempt"], a["outcome"]) for a in await attempts(db, event_id)] == [(1, "delivered")]


async def test_the_cli_sets_events_per_post_keeps_it_and_refuses_one_out_of_range(stack, db, merchant, processes):
    url = merchant.url + "/webhooks"
    code, output = await processes.cli("clients", "create", "list-shop", "--webhook-url", url,
                                       "--events-per-post", "20")
    assert code == 0 and "at most 20" in output, output

    async def stored() -> int:
        return await db.fetchval("SELECT w.events_per_post FROM webhook_endpoint w JOIN client c ON c.id = w.client_id "
                                 "WHERE c.name = 'list-shop'")

    assert await stored() == 20
    code, output = await processes.cli("clients", "set-webhook", "list-shop", url, "--rotate-secret")
    assert code == 0 and await stored() == 20, "a change that does not name it keeps it"
    for wrong in ("0", "101"):
        code, output = await processes.cli("clients", "set-webhook", "list-shop", url, "--events-per-post", wrong)
        assert code == 2 and "1 to 100" in output, output
    assert await stored() == 20
    code, output = await processes.cli("clients", "create", "no-hook", "--events-per-post", "5")
    assert code == 2 and "--webhook-url" in output, output
    assert await db.fetchval("SELECT count(*) FROM client WHERE name = 'no-hook'") == 0, "nothing created"
    code, output = await processes.cli("clients", "set-webhook", "list-shop", url, "--events-per-post", "1")
    assert code == 0 and await stored() == 1


async def test_a_list_still_in_flight_when_its_batch_moves_on_is_recorded_event_by_event_when_it_ends(
    http, stack, db, shop, merchant, processes
):
    # The merchant answers after 1.5 s: past the second the cursor waits for a
    # batch's POSTs (CURSOR_PATIENCE_SECONDS), within the POST's timeout.
    await takes_lists(db, shop, 10)
    await set_merchant_faults(http, merchant, {"action": "delay", "seconds": 1.5})
    paid = await waiting(http, stack, db, shop, 3)

    processes.worker(**{**FAST, "WEBHOOK_TIMEOUT_SECONDS": "3", "WEBHOOK_LEASE_SECONDS": "6"})
    await all_delivered(db, paid)

    moved_at = await db.fetchval("SELECT moved_at FROM webhook_cursor")
    for payment, event_id in paid:
        await assert_applied_once(db, payment, event_id)
        made = await attempts(db, event_id)
        assert [(a["attempt"], a["outcome"], a["status_code"]) for a in made] == [(1, "delivered", 200)], \
            "the list's one attempt, recorded through each row's lease: none waited for its lease to run out"
        assert made[0]["latency_ms"] >= 1500
        delivered_at = await db.fetchval("SELECT delivered_at FROM webhook_delivery WHERE event_id = $1", event_id)
        assert delivered_at > moved_at, "recorded after the cursor had moved past it, as an attempt in flight"
    assert [(p["events"], p["outcome"]) for p in await posts(db)] == [(3, "applied")]


async def test_a_read_takes_as_many_events_as_its_free_slots_carry_in_lists(
    http, stack, db, shop, merchant, processes
):
    """Two slots, forty events waiting for an endpoint of lists of 16: reads of 2, then 32 (two full lists), then 6.

    The first read knows nothing of the endpoint and asks for an event a
    slot; after it, each read asks for what its slots' lists carry. Bug
    caught: a read that counts events against its slots (as until
    2026-12-05), which sends twenty lists of two and leaves the merchant's
    lists, and a backlog's catching up, at the slots' count.
    """
    await takes_lists(db, shop, 16)
    paid = await waiting(http, stack, db, shop, 40)

    processes.worker(**FAST, WEBHOOK_CONCURRENCY="2")
    await all_delivered(db, paid)

    got = await posts(db)
    assert sorted(p["events"] for p in got) == [2, 6, 16, 16], [p["events"] for p in got]
    assert all(p["outcome"] == "applied" for p in got)
    for payment, event_id in paid:
        await assert_applied_once(db, payment, event_id)
