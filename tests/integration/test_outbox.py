"""The outbox: every decision a client must hear about is an event row, written with the decision.

Evidence is durable: the event rows beside the payment and key rows they
describe, and what `GET /v1/events` lists. (Crashes around the phases that
write events are in tests/crash/; the webhooks that carry them are in
tests/crash/test_webhook_delivery.py, and which events the dispatcher reads
for them in tests/integration/test_webhook_cursor.py.)
"""

from __future__ import annotations

import json
import uuid

import pytest

from app.outbox import events
from tests.conftest import LEGACY_IBAN
from tests.support import headers, key_row, payment_body, until


async def set_faults(http, service, *faults) -> None:
    (await http.put(service.url + "/_admin/faults", json={"faults": list(faults)})).raise_for_status()


async def events_of(db, payment_id) -> list:
    return await db.fetch("SELECT * FROM event WHERE payment_id = $1 ORDER BY id", payment_id)


async def pay(http, stack, client, body) -> tuple[str, dict]:
    key = str(uuid.uuid4())
    response = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(client, key))
    assert response.status_code in (201, 202), response.text
    return key, response.json()


@pytest.mark.parametrize(
    "card, reject, status",
    [("tok_visa", False, "succeeded"), ("tok_decline", False, "declined"), ("tok_visa", True, "failed")],
)
async def test_each_final_outcome_writes_one_event_carrying_the_stored_response(
    card, reject, status, http, stack, db, acme
):
    body = payment_body(card_token=card)
    if reject:
        await set_faults(http, stack.rail, {"action": "reject", "reference": body["reference"]})

    key, answer = await pay(http, stack, acme, body)

    assert answer["status"] == status
    [event] = await events_of(db, answer["id"])
    assert event["type"] == f"payment.{status}" and event["client_id"] == acme.id
    row = await key_row(db, acme.id, key)
    assert event["data"] == row["response_body"], "the event carries the stored response, the same text"
    assert uuid.UUID(str(event["id"])).version == 7
    # A replay decides nothing: no second event.
    await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))
    assert len(await events_of(db, answer["id"])) == 1


async def test_a_parked_payment_writes_an_indeterminate_event_with_what_the_client_was_told(
    http, stack, db, acme, processes
):
    body = payment_body(beneficiary={"name": "Old Bank Customer", "iban": LEGACY_IBAN})
    await set_faults(http, stack.rail, {"action": "error_before", "status": 500, "reference": body["reference"]})

    _, answer = await pay(http, stack, acme, body)

    assert answer["status"] == "indeterminate"
    [event] = await events_of(db, answer["id"])
    assert event["type"] == events.INDETERMINATE
    assert json.loads(event["data"]) == answer, "the payment as the client was told it"


async def feed(http, stack, client, **params) -> dict:
    response = await http.get(f"{stack.api}/v1/events", params=params, headers=client.auth)
    assert response.status_code == 200, response.text
    return response.json()


async def test_the_feed_lists_only_the_callers_events_in_order_and_pages_by_cursor(http, stack, db, acme, globex):
    mine = [(await pay(http, stack, acme, payment_body()))[1]["id"] for _ in range(3)]
    theirs = (await pay(http, stack, globex, payment_body()))[1]["id"]

    async def all_visible() -> bool:
        return len((await feed(http, stack, acme))["data"]) == 3 and len((await feed(http, stack, globex))["data"]) == 1

    await until(all_visible, "the events to pass the feed's one-second horizon", timeout=10)
    page = await feed(http, stack, acme, limit=2)
    assert [e["data"]["id"] for e in page["data"]] == mine[:2] and page["has_more"] is True
    assert all(e["type"] == "payment.succeeded" and e["object"] == "event" for e in page["data"])
    rest = await feed(http, stack, acme, after=page["next_after"], limit=2)
    assert [e["data"]["id"] for e in rest["data"]] == mine[2:] and rest["has_more"] is False
    ids = [e["id"] for e in page["data"] + rest["data"]]
    assert ids == sorted(ids, key=uuid.UUID), "ids sort by time"
    shown = await http.get(f"{stack.api}/v1/payments/{mine[0]}", headers=acme.auth)
    assert page["data"][0]["data"] == shown.json(), "the payment's public view, nothing more"
    assert "card_token" not in json.dumps(page)
    other = await feed(http, stack, globex)
    assert [e["data"]["id"] for e in other["data"]] == [theirs], "another client's events are never shown"
    # A cursor past the end: an empty page that keeps the cursor.
    end = await feed(http, stack, acme, after=rest["next_after"])
    assert end == {"object": "list", "data": [], "has_more": False, "next_after": rest["next_after"]}


def uuid7_at(millis: int) -> uuid.UUID:
    """A version-7 id whose time is `millis` (the rest zero but the version and variant)."""
    return uuid.UUID(int=(millis << 80) | (0x7 << 76) | (0b10 << 62))


async def test_the_feed_holds_back_events_younger_than_its_horizon(http, stack, db, acme):
    _, answer = await pay(http, stack, acme, payment_body())
    now = await db.fetchval("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint")
    # Two more events of the same payment, written straight in: one from a
    # minute ago, one whose id says it was made a minute from now (younger
    # than the horizon for a minute yet).
    old, young = uuid7_at(now - 60_000), uuid7_at(now + 60_000)
    for event_id in (old, young):
        await db.execute(
            "INSERT INTO event (id, client_id, payment_id, type, data) VALUES ($1, $2, $3, 'payment.succeeded', $4)",
            event_id, acme.id, uuid.UUID(answer["id"]), json.dumps(answer),
        )

    async def listed() -> list[str]:
        return [e["id"] for e in (await feed(http, stack, acme))["data"]]

    async def real_one_listed() -> bool:
        return len(await listed()) == 2

    await until(real_one_listed, "the payment's own event to pass the horizon", timeout=10)
    assert str(old) in await listed()
    assert str(young) not in await listed()


@pytest.mark.parametrize(
    "params, status",
    [({"after": "not-a-uuid"}, 400), ({"limit": 0}, 400), ({"limit": 101}, 400)],
)
async def test_a_malformed_feed_request_is_a_400_problem(params, status, http, stack, acme):
    response = await http.get(f"{stack.api}/v1/events", params=params, headers=acme.auth)
    assert response.status_code == status
    assert response.headers["content-type"] == "application/problem+json"


async def test_the_feed_needs_an_api_key(http, stack):
    response = await http.get(f"{stack.api}/v1/events")
    assert response.status_code == 401 and response.json()["type"] == "/problems/unauthenticated"


async def test_the_database_makes_time_ordered_version_7_ids(db):
    before = await db.fetchval("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint")
    ids = [uuid.UUID(str(await db.fetchval("SELECT time_ordered_uuid()"))) for _ in range(5)]
    after = await db.fetchval("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint")

    assert all(i.version == 7 and i.variant == uuid.RFC_4122 for i in ids)
    millis = [i.int >> 80 for i in ids]
    assert all(before - 1 <= m <= after + 1 for m in millis), "the first 48 bits are the time in milliseconds"
    assert millis == sorted(millis)
    assert len(set(ids)) == 5
