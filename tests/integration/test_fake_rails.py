"""The fake PSP and fake rail behave like the real systems the service depends on.

Both apps run in-process on a real PostgreSQL; each test starts from empty
tables and an empty fault plan, and checks the stored rows, not only the
HTTP answers.
"""

from __future__ import annotations

import asyncio
import os
import time
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import pytest

from fake_rails import psp as psp_module
from fake_rails import rail as rail_module
from fake_rails.common import asyncpg_dsn

PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def rails_db_url(request: pytest.FixtureRequest) -> str:
    return os.environ.get("TEST_DATABASE_URL") or request.getfixturevalue("database_url")


async def _serve(app, base_url: str):
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=base_url) as client:
            yield client


@pytest.fixture(scope="module")
async def psp(rails_db_url: str):
    async for client in _serve(psp_module.create_app(rails_db_url), "http://fake-psp"):
        yield client


@pytest.fixture(scope="module")
async def rail(rails_db_url: str):
    async for client in _serve(rail_module.create_app(rails_db_url), "http://fake-rail"):
        yield client


@pytest.fixture(scope="module")
async def db(rails_db_url: str, psp, rail):  # the apps create the tables
    conn = await asyncpg.connect(asyncpg_dsn(rails_db_url))
    yield conn
    await conn.close()


@pytest.fixture(autouse=True)
async def clean(db, psp, rail):
    await db.execute("TRUNCATE fake_psp.charge, fake_psp.refund, fake_rail.transfer")
    await psp.delete("/_admin/faults")
    await rail.delete("/_admin/faults")


def charge_body(reference: str = "order-1", **overrides) -> dict:
    return {
        "amount": 1250,
        "currency": "EUR",
        "card_token": "tok_visa",
        "reference": reference,
        "description": None,
    } | overrides


def transfer_body(reference: str = "payout-1", **overrides) -> dict:
    return {
        "end_to_end_reference": f"E2E-{reference}",
        "amount": 9900,
        "currency": "EUR",
        "beneficiary_iban": "DE89370400440532013000",
        "beneficiary_name": "Ada Lovelace",
        "reference": reference,
    } | overrides


async def post(client: httpx.AsyncClient, path: str, body: dict, key: str) -> httpx.Response:
    return await client.post(path, json=body, headers={"Idempotency-Key": key})


async def set_faults(client: httpx.AsyncClient, *faults: dict) -> None:
    response = await client.put("/_admin/faults", json={"faults": list(faults)})
    assert response.status_code == 200, response.text


async def rows(db, table: str) -> list[asyncpg.Record]:
    return await db.fetch(f"SELECT * FROM {table} ORDER BY created_at, id")


def utc_today():
    return datetime.now(UTC).date()


# --- Idempotency --------------------------------------------------------------


async def test_a_retry_with_the_same_key_and_body_replays_the_stored_charge(psp, db):
    first = await post(psp, "/v1/charges", charge_body(), "k1")
    # Same body, other key order and an omitted null: still the same request.
    body = dict(reversed(charge_body().items()))
    del body["description"]
    second = await post(psp, "/v1/charges", body, "k1")

    assert first.status_code == second.status_code == 201
    assert "Idempotent-Replayed" not in first.headers
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.content == first.content
    assert first.json()["id"].startswith("ch_") and len(first.json()["id"]) == 27
    [row] = await rows(db, "fake_psp.charge")
    assert row["id"] == first.json()["id"]
    assert (row["idempotency_key"], row["status"]) == ("k1", "succeeded")


async def test_a_key_reused_with_a_different_body_is_refused_with_422(psp, db):
    await post(psp, "/v1/charges", charge_body(amount=100), "k1")
    response = await post(psp, "/v1/charges", charge_body(amount=200), "k1")

    assert response.status_code == 422
    assert response.headers["content-type"] == PROBLEM
    assert response.json()["type"].endswith("/idempotency-key-reused")
    assert [r["amount"] for r in await rows(db, "fake_psp.charge")] == [100]


@pytest.mark.parametrize(
    ("service", "path", "body", "table"),
    [
        ("psp", "/v1/charges", charge_body(), "fake_psp.charge"),
        ("psp", "/v1/refunds", None, "fake_psp.refund"),
        ("rail", "/v1/transfers", transfer_body(), "fake_rail.transfer"),
    ],
)
async def test_twenty_concurrent_posts_with_one_key_create_exactly_one_record(
    request, db, service, path, body, table
):
    client = request.getfixturevalue(service)
    if body is None:
        charge = await post(client, "/v1/charges", charge_body(), "charge-key")
        body = {"charge_id": charge.json()["id"], "amount": 1250, "reference": "order-1"}

    responses = await asyncio.gather(*(post(client, path, body, "same-key") for _ in range(20)))

    assert {r.status_code for r in responses} == {201}
    assert len({r.json()["id"] for r in responses}) == 1
    assert sum("Idempotent-Replayed" not in r.headers for r in responses) == 1
    assert await db.fetchval(f"SELECT count(*) FROM {table}") == 1


async def test_a_post_without_an_idempotency_key_is_refused_and_not_recorded(psp, rail, db):
    for client, path, body in [
        (psp, "/v1/charges", charge_body()),
        (rail, "/v1/transfers", transfer_body()),
    ]:
        response = await client.post(path, json=body)
        assert response.status_code == 400
        assert response.json()["type"].endswith("/idempotency-key-missing")
    assert await rows(db, "fake_psp.charge") == await rows(db, "fake_rail.transfer") == []


@pytest.mark.parametrize(
    "overrides",
    [{"amount": 0}, {"amount": "1250"}, {"currency": "eur"}, {"card_token": None}, {"extra": 1}],
)
async def test_an_invalid_charge_is_a_400_problem(psp, db, overrides):
    response = await post(psp, "/v1/charges", charge_body(**overrides), "k1")

    assert response.status_code == 400
    assert response.headers["content-type"] == PROBLEM
    assert response.json()["status"] == 400
    assert await rows(db, "fake_psp.charge") == []


async def test_an_end_to_end_reference_longer_than_35_characters_is_a_400(rail):
    response = await post(rail, "/v1/transfers", transfer_body(end_to_end_reference="E" * 36), "k1")
    assert response.status_code == 400


async def test_records_survive_a_restart_of_the_fake(rails_db_url, psp):
    first = await post(psp, "/v1/charges", charge_body(), "k1")

    async for restarted in _serve(psp_module.create_app(rails_db_url), "http://fake-psp"):
        replay = await post(restarted, "/v1/charges", charge_body(), "k1")

    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json() == first.json()


# --- Probes and listings ------------------------------------------------------


async def test_the_charge_probe_finds_a_charge_by_key_and_404s_an_unknown_key(psp):
    created = await post(psp, "/v1/charges", charge_body(), "k1")

    found = await psp.get("/v1/charges", params={"idempotency_key": "k1"})
    missing = await psp.get("/v1/charges", params={"idempotency_key": "never-sent"})

    assert found.status_code == 200 and found.json() == created.json()
    assert missing.status_code == 404 and missing.headers["content-type"] == PROBLEM


async def test_the_transfer_probe_finds_a_transfer_by_end_to_end_reference(rail):
    created = await post(rail, "/v1/transfers", transfer_body(), "k1")

    found = await rail.get("/v1/transfers/E2E-payout-1")
    missing = await rail.get("/v1/transfers/E2E-unknown")

    assert found.status_code == 200 and found.json() == created.json()
    assert missing.status_code == 404 and missing.json()["type"].endswith("/not-found")


async def test_admin_listings_show_every_record_oldest_first_filtered_by_reference(psp):
    for i, reference in enumerate(["a", "b", "a"]):
        await post(psp, "/v1/charges", charge_body(reference), f"k{i}")

    everything = (await psp.get("/_admin/charges")).json()["items"]
    only_a = (await psp.get("/_admin/charges", params={"reference": "a"})).json()["items"]

    assert [c["idempotency_key"] for c in everything] == ["k0", "k1", "k2"]
    assert [c["idempotency_key"] for c in only_a] == ["k0", "k2"]


# --- Fault plan ---------------------------------------------------------------


async def test_error_after_records_the_charge_and_a_retry_replays_it(psp, db):
    await set_faults(psp, {"action": "error_after", "operation": "charge"})

    lost = await post(psp, "/v1/charges", charge_body(), "k1")
    [row] = await rows(db, "fake_psp.charge")
    retry = await post(psp, "/v1/charges", charge_body(), "k1")

    assert lost.status_code == 500 and lost.headers["content-type"] == PROBLEM
    assert row["status"] == "succeeded"
    assert retry.status_code == 201
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.json()["id"] == row["id"]
    assert len(await rows(db, "fake_psp.charge")) == 1


@pytest.mark.parametrize(
    ("fault", "status"),
    [
        ({"action": "error_before"}, 503),
        ({"action": "error_before", "status": 502}, 502),
        ({"action": "rate_limit"}, 429),
    ],
)
async def test_error_before_and_rate_limit_record_nothing(rail, db, fault, status):
    await set_faults(rail, fault)

    refused = await post(rail, "/v1/transfers", transfer_body(), "k1")
    recorded = await rows(db, "fake_rail.transfer")
    retry = await post(rail, "/v1/transfers", transfer_body(), "k1")

    assert refused.status_code == status and refused.headers["content-type"] == PROBLEM
    if status == 429:
        assert refused.headers["Retry-After"] == "1"
    assert recorded == []
    # The fault was used up, and the retry is the first time the key is seen.
    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry.headers
    assert len(await rows(db, "fake_rail.transfer")) == 1


async def test_hang_after_records_the_transfer_while_the_caller_times_out(rail, db):
    await set_faults(rail, {"action": "hang_after", "seconds": 30})

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(post(rail, "/v1/transfers", transfer_body(), "k1"), timeout=0.5)
    [row] = await rows(db, "fake_rail.transfer")
    probe = await rail.get("/v1/transfers/E2E-payout-1")
    retry = await post(rail, "/v1/transfers", transfer_body(), "k1")

    assert probe.json()["id"] == retry.json()["id"] == row["id"]
    assert retry.headers["Idempotent-Replayed"] == "true"


async def test_delay_slows_the_call_down_and_then_processes_it(psp, db):
    await set_faults(psp, {"action": "delay", "seconds": 0.3})

    started = time.monotonic()
    response = await post(psp, "/v1/charges", charge_body(), "k1")

    assert time.monotonic() - started >= 0.3
    assert response.status_code == 201
    assert len(await rows(db, "fake_psp.charge")) == 1


async def test_a_decline_fault_hits_only_its_reference_as_many_times_as_asked(psp, db):
    await set_faults(psp, {"action": "decline", "reference": "order-2", "times": 1})

    await post(psp, "/v1/charges", charge_body("order-1"), "k1")
    declined = await post(psp, "/v1/charges", charge_body("order-2"), "k2")
    await post(psp, "/v1/charges", charge_body("order-2"), "k3")
    plan = (await psp.get("/_admin/faults")).json()["faults"]

    assert declined.status_code == 201
    assert declined.json()["status"] == "declined"
    assert declined.json()["decline_code"] == "card_declined"
    stored = await rows(db, "fake_psp.charge")
    assert [(r["idempotency_key"], r["status"], r["decline_code"]) for r in stored] == [
        ("k1", "succeeded", None),
        ("k2", "declined", "card_declined"),
        ("k3", "succeeded", None),
    ]
    assert plan[0]["times"] == 0


async def test_the_magic_card_tokens_are_declined_with_their_codes(psp, db):
    await post(psp, "/v1/charges", charge_body(card_token="tok_decline"), "k1")
    await post(psp, "/v1/charges", charge_body(card_token="tok_insufficient_funds"), "k2")

    assert [(r["status"], r["decline_code"]) for r in await rows(db, "fake_psp.charge")] == [
        ("declined", "card_declined"),
        ("declined", "insufficient_funds"),
    ]


async def test_a_reject_fault_with_null_times_rejects_every_matching_transfer(rail, db):
    await set_faults(rail, {"action": "reject", "reference": "closed", "times": None})

    for i, reference in enumerate(["closed", "open", "closed"]):
        body = transfer_body(reference, end_to_end_reference=f"E2E-{i}")
        await post(rail, "/v1/transfers", body, f"k{i}")

    assert [
        (r["reference"], r["status"], r["reject_reason"], r["booking_date"])
        for r in await rows(db, "fake_rail.transfer")
    ] == [
        ("closed", "rejected", "account_closed", None),
        ("open", "accepted", None, utc_today()),
        ("closed", "rejected", "account_closed", None),
    ]


async def test_a_fault_the_service_cannot_apply_is_refused(psp, rail):
    async def put(client, fault: dict) -> int:
        return (await client.put("/_admin/faults", json={"faults": [fault]})).status_code

    assert await put(rail, {"action": "decline"}) == 400
    assert await put(psp, {"action": "reject"}) == 400
    assert await put(psp, {"action": "decline", "operation": "refund"}) == 400
    assert await put(psp, {"action": "delay", "operation": "transfer"}) == 400
    assert await put(psp, {"action": "explode"}) == 400
    assert (await psp.get("/_admin/faults")).json() == {"faults": []}


async def test_the_fault_plan_shows_its_defaults_and_can_be_cleared(psp):
    await set_faults(
        psp, {"action": "delay"}, {"action": "hang_after"}, {"action": "error_after", "times": None}
    )

    plan = (await psp.get("/_admin/faults")).json()["faults"]
    cleared = await psp.delete("/_admin/faults")

    assert [(f["seconds"], f["status"], f["times"]) for f in plan] == [
        (2.0, None, 1),
        (3600.0, None, 1),
        (None, 500, None),
    ]
    assert cleared.json() == {"faults": []}


# --- Statements ---------------------------------------------------------------


async def test_the_statement_lists_the_accepted_transfers_booked_that_day(rail):
    await set_faults(rail, {"action": "reject", "reference": "payout-2"})
    for i in range(3):
        await post(rail, "/v1/transfers", transfer_body(f"payout-{i}"), f"k{i}")
    today = utc_today()

    statement = (await rail.get(f"/v1/statements/{today}")).json()
    yesterday = (await rail.get(f"/v1/statements/{today - timedelta(days=1)}")).json()

    assert statement["date"] == today.isoformat()
    assert statement["final"] is False
    day = today.isoformat()
    assert [
        (e["end_to_end_reference"], e["amount"], e["currency"], e["booking_date"], e["value_date"])
        for e in statement["entries"]
    ] == [("E2E-payout-0", 9900, "EUR", day, day), ("E2E-payout-1", 9900, "EUR", day, day)]
    assert all(e["transfer_id"].startswith("tr_") for e in statement["entries"])
    assert yesterday == {"date": yesterday["date"], "final": True, "entries": []}


@pytest.mark.parametrize("day", ["2025-13-01", "20250101", "yesterday"])
async def test_a_statement_for_a_malformed_date_is_a_400(rail, day):
    response = await rail.get(f"/v1/statements/{day}")
    assert response.status_code == 400 and response.headers["content-type"] == PROBLEM


# --- Refunds ------------------------------------------------------------------


async def charge(psp, key: str = "charge-1", **overrides) -> dict:
    return (await post(psp, "/v1/charges", charge_body(**overrides), key)).json()


def refund(psp, charge_id: str, amount: int, key: str):
    body = {"charge_id": charge_id, "amount": amount, "reference": "r"}
    return post(psp, "/v1/refunds", body, key)


async def test_a_refund_of_an_unknown_or_declined_charge_is_refused_unrecorded(psp, db):
    declined = await charge(psp, card_token="tok_decline")

    unknown = await refund(psp, "ch_nope", 1, "k1")
    refused = await refund(psp, declined["id"], 1, "k2")

    assert unknown.status_code == 404
    assert refused.status_code == 409 and refused.json()["type"].endswith("/charge-not-refundable")
    assert await rows(db, "fake_psp.refund") == []


async def test_refunds_may_not_exceed_what_is_left_of_the_charge(psp, db):
    ch = await charge(psp, amount=100)

    first = await refund(psp, ch["id"], 60, "k1")
    too_much = await refund(psp, ch["id"], 50, "k2")
    rest = await refund(psp, ch["id"], 40, "k3")
    # A replay is not checked again, though nothing is left to refund now.
    replay = await refund(psp, ch["id"], 60, "k1")

    assert first.status_code == rest.status_code == 201
    assert first.json()["id"].startswith("re_") and first.json()["object"] == "refund"
    assert too_much.status_code == 409
    assert too_much.json()["type"].endswith("/refund-exceeds-charge")
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    stored = await rows(db, "fake_psp.refund")
    assert [(r["idempotency_key"], r["amount"]) for r in stored] == [("k1", 60), ("k3", 40)]


async def test_concurrent_refunds_with_different_keys_cannot_overdraw_a_charge(psp, db):
    ch = await charge(psp, amount=100)

    responses = await asyncio.gather(*(refund(psp, ch["id"], 30, f"k{i}") for i in range(10)))

    assert sorted(r.status_code for r in responses) == [201] * 3 + [409] * 7
    assert await db.fetchval("SELECT sum(amount) FROM fake_psp.refund") == 90
