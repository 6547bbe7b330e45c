"""The fake PSP and fake rail behave like the real systems the service depends on.

Both apps run in-process on a real PostgreSQL; each test starts from empty
tables and an empty fault plan, and checks the stored rows, not only the
HTTP answers.
"""

from __future__ import annotations

import asyncio
import os
import time
from datetime import UTC, date, datetime, time as clock, timedelta, timezone

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


# No cut-off: what day a transfer is booked on must not depend on the hour
# the suite runs at. The cut-off is tested on booking_date_for directly.
@pytest.fixture(scope="module")
async def rail(rails_db_url: str):
    app = rail_module.create_app(rails_db_url, cutoff=None)
    async for client in _serve(app, "http://fake-rail"):
        yield client


LEGACY_IBAN = "GB33BUKB20201555555555"  # an old bank behind the rail


@pytest.fixture
async def legacy_rail(rails_db_url: str):
    """A whole rail in legacy mode (`fake-rail --legacy`)."""
    app = rail_module.create_app(rails_db_url, legacy=True, cutoff=None)
    async for client in _serve(app, "http://legacy-rail"):
        yield client


@pytest.fixture
async def account_rail(rails_db_url: str):
    """A rail where only transfers to LEGACY_IBAN are legacy (`--legacy-accounts`)."""
    app = rail_module.create_app(rails_db_url, legacy_accounts={LEGACY_IBAN}, cutoff=None)
    async for client in _serve(app, "http://account-rail"):
        yield client


@pytest.fixture(scope="module")
async def db(rails_db_url: str, psp, rail):  # the apps create the tables
    conn = await asyncpg.connect(asyncpg_dsn(rails_db_url))
    yield conn
    await conn.close()


@pytest.fixture(autouse=True)
async def clean(db, psp, rail):
    await db.execute(
        "TRUNCATE fake_psp.charge, fake_psp.refund, fake_psp.request, fake_psp.closed_day, "
        "fake_rail.transfer, fake_rail.closed_day, fake_rail.request"
    )
    await psp.delete("/_admin/faults")
    await rail.delete("/_admin/faults")
    yield
    # A closed today would move the bookings of every later test, in this
    # session's other rails too (they share the database).
    await db.execute("TRUNCATE fake_rail.closed_day, fake_psp.closed_day")


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
    assert yesterday == {"date": yesterday["date"], "final": True, "entries": [], "returns": []}


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


# --- Pending refunds, over-refunds, the settlement report ---------------------

# Long enough never to come due during a test: only the admin endpoint settles it.
LATER = 3600


async def probe_refund(psp, key: str) -> dict:
    response = await psp.get("/v1/refunds", params={"idempotency_key": key})
    assert response.status_code == 200, response.text
    return response.json()


async def test_a_pending_refund_is_answered_pending_until_settled_then_final_everywhere(psp, db):
    ch = await charge(psp, amount=100)
    await set_faults(psp, {"action": "pending", "seconds": LATER})

    created = await refund(psp, ch["id"], 40, "k1")
    before = await probe_refund(psp, "k1")
    settled = await psp.post(f"/_admin/refunds/{created.json()['id']}/settle", json={"status": "succeeded"})
    after = await probe_refund(psp, "k1")
    replay = await refund(psp, ch["id"], 40, "k1")
    again = await psp.post(f"/_admin/refunds/{created.json()['id']}/settle", json={"status": "failed"})
    unknown = await psp.post("/_admin/refunds/re_nope/settle", json={"status": "succeeded"})

    assert created.status_code == 201
    assert created.json()["status"] == before["status"] == "pending"
    assert before["settled_at"] is None
    assert settled.status_code == 200 and settled.json()["status"] == "succeeded"
    assert after["status"] == "succeeded" and after["settled_at"] is not None
    # The stored answer was updated in place: a replay shows the refund as it is now.
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.json() == after
    assert list(after) == list(created.json())
    assert again.status_code == 409 and again.json()["type"].endswith("/refund-not-pending")
    assert unknown.status_code == 404
    (row,) = await rows(db, "fake_psp.refund")
    assert (row["status"], row["failure_code"]) == ("succeeded", None)


async def test_a_pending_refund_counts_against_the_charge_until_it_fails(psp, db):
    ch = await charge(psp, amount=100)
    await set_faults(psp, {"action": "pending", "seconds": LATER})
    pending = (await refund(psp, ch["id"], 100, "k1")).json()

    while_pending = await refund(psp, ch["id"], 1, "k2")
    await psp.post(f"/_admin/refunds/{pending['id']}/settle", json={"status": "failed"})
    after_failure = await refund(psp, ch["id"], 100, "k3")

    assert while_pending.status_code == 409
    assert after_failure.status_code == 201 and after_failure.json()["status"] == "succeeded"
    assert [(r["idempotency_key"], r["status"]) for r in await rows(db, "fake_psp.refund")] == [
        ("k1", "failed"), ("k3", "succeeded"),
    ]


@pytest.mark.parametrize("settles_as", ["succeeded", "failed"])
async def test_a_pending_refund_due_now_settles_as_planned_at_the_first_read(psp, db, settles_as):
    ch = await charge(psp, amount=100)
    await set_faults(psp, {"action": "pending", "seconds": 0, "settles_as": settles_as})

    created = await refund(psp, ch["id"], 100, "k1")
    (stored,) = await rows(db, "fake_psp.refund")  # no read of the PSP yet
    probed = await probe_refund(psp, "k1")
    (row,) = await rows(db, "fake_psp.refund")
    # Only a failed refund gives the charge's amount back.
    full_again = await refund(psp, ch["id"], 100, "k2")

    assert created.json()["status"] == stored["status"] == "pending"
    assert probed["status"] == row["status"] == settles_as
    expected_code = "expired_or_canceled_card" if settles_as == "failed" else None
    assert probed["failure_code"] == row["failure_code"] == expected_code
    # Settled as of when it was due, not of when it was read.
    assert row["settled_at"] == row["settles_at"] == row["created_at"]
    assert full_again.status_code == (201 if settles_as == "failed" else 409)


async def test_allow_over_refund_records_a_refund_the_balance_would_refuse_and_flags_it(psp, db):
    ch = await charge(psp, amount=100)
    await refund(psp, ch["id"], 60, "k1")

    guarded = await refund(psp, ch["id"], 50, "k2")
    stored_guarded = await rows(db, "fake_psp.refund")
    await set_faults(psp, {"action": "allow_over_refund", "times": None})
    over = await refund(psp, ch["id"], 50, "k3")
    within = await refund(psp, ch["id"], 1, "k4")  # nothing left: an over-refund too
    ch2 = await charge(psp, "charge-2", amount=100)
    fits = await refund(psp, ch2["id"], 100, "k5")
    listed = (await psp.get("/_admin/refunds")).json()["items"]

    assert guarded.status_code == 409 and guarded.json()["type"].endswith("/refund-exceeds-charge")
    assert [r["idempotency_key"] for r in stored_guarded] == ["k1"]
    assert over.status_code == within.status_code == fits.status_code == 201
    assert "over_refund" not in over.json()  # the caller's answer stays the documented one
    assert [(i["idempotency_key"], i["over_refund"]) for i in listed] == [
        ("k1", False), ("k3", True), ("k4", True), ("k5", False),
    ]


async def test_allow_over_refund_leaves_the_requests_own_fault_in_effect(psp, db):
    ch = await charge(psp, amount=100)
    await refund(psp, ch["id"], 100, "k1")
    await set_faults(
        psp,
        {"action": "allow_over_refund", "times": None},
        {"action": "error_after", "operation": "refund"},
        {"action": "pending", "seconds": LATER},
    )

    lost = await refund(psp, ch["id"], 30, "k2")
    pending = await refund(psp, ch["id"], 30, "k3")

    assert lost.status_code == 500  # recorded, answer lost
    assert pending.status_code == 201 and pending.json()["status"] == "pending"
    assert [(r["idempotency_key"], r["status"], r["over_refund"]) for r in await rows(db, "fake_psp.refund")] == [
        ("k1", "succeeded", False), ("k2", "succeeded", True), ("k3", "pending", True),
    ]


async def test_the_settlement_report_lists_the_days_final_refunds_and_becomes_final_on_close(psp):
    ch = await charge(psp, amount=1000)
    await refund(psp, ch["id"], 100, "k-now")
    await set_faults(psp, {"action": "pending", "seconds": LATER, "times": 2})
    to_fail = (await refund(psp, ch["id"], 200, "k-fail")).json()
    still_pending = (await refund(psp, ch["id"], 300, "k-pending")).json()
    await psp.post(f"/_admin/refunds/{to_fail['id']}/settle", json={"status": "failed"})
    today = utc_today()

    report = (await psp.get(f"/v1/settlements/{today}")).json()
    closed = await psp.post("/_admin/close-day", json={"date": today.isoformat()})
    final = (await psp.get(f"/v1/settlements/{today}")).json()
    # Settled after the close: on the next open day's report, never on a final one.
    await psp.post(f"/_admin/refunds/{still_pending['id']}/settle", json={"status": "succeeded"})
    after = (await psp.get(f"/v1/settlements/{today}")).json()
    tomorrow = (await psp.get(f"/v1/settlements/{today + timedelta(days=1)}")).json()
    yesterday = (await psp.get(f"/v1/settlements/{today - timedelta(days=1)}")).json()

    assert report["date"] == today.isoformat() and report["final"] is False
    assert [
        (r["idempotency_key"], r["charge_id"], r["amount"], r["currency"], r["status"], r["failure_code"])
        for r in report["refunds"]
    ] == [
        ("k-now", ch["id"], 100, "EUR", "succeeded", None),
        ("k-fail", ch["id"], 200, "EUR", "failed", "expired_or_canceled_card"),
    ]
    assert all(r["refund_id"].startswith("re_") and r["settled_at"] for r in report["refunds"])
    assert closed.status_code == 200
    assert final == report | {"final": True} == after
    assert [r["idempotency_key"] for r in tomorrow["refunds"]] == ["k-pending"]
    assert tomorrow["final"] is False
    assert yesterday == {"date": yesterday["date"], "final": True, "refunds": []}


async def test_closing_a_day_first_settles_what_was_due_on_it(psp, db):
    ch = await charge(psp, amount=100)
    await set_faults(psp, {"action": "pending", "seconds": 0})
    await refund(psp, ch["id"], 100, "k1")  # due at once, never read

    await psp.post("/_admin/close-day", json={"date": utc_today().isoformat()})
    report = (await psp.get(f"/v1/settlements/{utc_today()}")).json()

    assert [(r["idempotency_key"], r["status"]) for r in report["refunds"]] == [("k1", "succeeded")]
    assert report["final"] is True


@pytest.mark.parametrize("day", ["2025-13-01", "20250101", "yesterday"])
async def test_a_settlement_report_for_a_malformed_date_is_a_400(psp, day):
    response = await psp.get(f"/v1/settlements/{day}")
    assert response.status_code == 400 and response.headers["content-type"] == PROBLEM


async def test_the_refund_faults_are_refused_elsewhere_and_show_their_defaults(psp):
    async def put(fault: dict) -> int:
        return (await psp.put("/_admin/faults", json={"faults": [fault]})).status_code

    assert await put({"action": "pending", "operation": "charge"}) == 400
    assert await put({"action": "allow_over_refund", "operation": "charge"}) == 400
    assert await put({"action": "delay", "settles_as": "failed"}) == 400
    assert await put({"action": "pending", "settles_as": "maybe"}) == 400
    await set_faults(psp, {"action": "pending"})
    (fault,) = (await psp.get("/_admin/faults")).json()["faults"]
    assert (fault["seconds"], fault["settles_as"]) == (2.0, "succeeded")


async def test_the_services_psp_client_reads_the_fakes_refunds_and_report(psp):
    """The contract both sides keep: the client's allow-list (app/rails) reads what this fake answers."""
    from app.rails.gateways import PSP
    from app.rails.outcomes import Applied, Settling

    charge_id = (await charge(psp, amount=100))["id"]

    class Refund:
        psp_charge_id = charge_id
        amount_minor = 40
        reference = "refund-1"

    client = PSP(psp, "http://fake-psp", timeout=5.0, transient_retries=0)
    await set_faults(psp, {"action": "pending", "seconds": LATER})

    sent = await client.client_refund("k1", Refund())
    probed = await client.find_client_refund("k1")
    refund_id = (await probe_refund(psp, "k1"))["id"]
    await psp.post(f"/_admin/refunds/{refund_id}/settle", json={"status": "failed"})
    settled = await client.find_client_refund("k1")
    report = await client.settlement_report(utc_today())

    assert sent == probed == Settling("psp: refund pending")
    assert isinstance(settled, Applied)
    assert (settled.record.status, settled.record.failure_code, settled.record.amount) == (
        "failed", "expired_or_canceled_card", 40,
    )
    assert report.final is False
    assert [(r.refund_id, r.status, r.currency) for r in report.refunds] == [(refund_id, "failed", "EUR")]


async def test_an_older_refund_table_gains_the_new_columns_at_start(rails_db_url, psp, db):
    ch = await charge(psp, amount=100)
    await refund(psp, ch["id"], 100, "k1")
    await db.execute(
        "ALTER TABLE fake_psp.refund DROP COLUMN failure_code, DROP COLUMN settles_at, "
        "DROP COLUMN settles_as, DROP COLUMN settled_at, DROP COLUMN settlement_date, DROP COLUMN over_refund"
    )

    app = psp_module.create_app(rails_db_url)
    async with app.router.lifespan_context(app):
        pass
    report = (await psp.get(f"/v1/settlements/{utc_today()}")).json()

    # Recorded before the report existed, final at creation: on its day's report.
    assert [r["idempotency_key"] for r in report["refunds"]] == ["k1"]
    (row,) = await rows(db, "fake_psp.refund")
    assert row["over_refund"] is False and row["settled_at"] == row["created_at"]


# --- Request log --------------------------------------------------------------


async def test_every_business_request_is_logged_in_order_whatever_it_was_answered(psp, rail, db):
    await set_faults(psp, {"action": "error_before", "reference": "order-log"})
    refused = await post(psp, "/v1/charges", charge_body("order-log"), "k-log")
    probe = await psp.get("/v1/charges", params={"idempotency_key": "k-log"})
    charged = await post(psp, "/v1/charges", charge_body("order-log"), "k-log")
    replayed = await post(psp, "/v1/charges", charge_body("order-log"), "k-log")
    sent = await post(rail, "/v1/transfers", transfer_body("payout-log"), "k-tr")
    probed = await rail.get("/v1/transfers/E2E-payout-log")
    await psp.get("/_admin/charges")  # admin and health requests are not logged
    await psp.get("/healthz")

    assert [refused.status_code, probe.status_code, charged.status_code, replayed.status_code] == [503, 404, 201, 201]
    assert sent.status_code == 201 and probed.status_code == 200
    logged = (await psp.get("/_admin/requests")).json()["items"]
    assert [(r["method"], r["path"], r["idempotency_key"], r["reference"]) for r in logged] == [
        ("POST", "/v1/charges", "k-log", "order-log"),
        ("GET", "/v1/charges", "k-log", None),
        ("POST", "/v1/charges", "k-log", "order-log"),
        ("POST", "/v1/charges", "k-log", "order-log"),
    ]
    assert logged[1]["query"] == "idempotency_key=k-log"
    assert [r["seq"] for r in logged] == sorted(r["seq"] for r in logged)
    assert (await psp.get("/_admin/requests", params={"reference": "nothing"})).json() == {"items": []}
    by_e2e = (await rail.get("/_admin/requests", params={"end_to_end_reference": "E2E-payout-log"})).json()["items"]
    assert [(r["method"], r["path"], r["idempotency_key"], r["reference"]) for r in by_e2e] == [
        ("POST", "/v1/transfers", "k-tr", "payout-log"),
        ("GET", "/v1/transfers/E2E-payout-log", None, None),
    ]
    # The same rows, in the fake's own schema, for tests that read it directly.
    assert await db.fetchval("SELECT count(*) FROM fake_psp.request") == 4
    assert await db.fetchval("SELECT count(*) FROM fake_rail.request") == 2


# --- Legacy mode --------------------------------------------------------------


async def test_a_legacy_rail_creates_a_transfer_for_every_post_even_with_one_key(
    legacy_rail, db
):
    first = await post(legacy_rail, "/v1/transfers", transfer_body(), "k1")
    second = await post(legacy_rail, "/v1/transfers", transfer_body(), "k1")
    keyless = await legacy_rail.post("/v1/transfers", json=transfer_body())

    assert first.status_code == second.status_code == keyless.status_code == 201
    assert not any("Idempotent-Replayed" in r.headers for r in (first, second, keyless))
    assert first.json()["id"] != second.json()["id"]
    assert first.json()["legacy"] is True and first.json()["idempotency_key"] is None
    stored = await rows(db, "fake_rail.transfer")
    assert [(r["id"], r["legacy"], r["idempotency_key"], r["presented_key"]) for r in stored] == [
        (first.json()["id"], True, None, "k1"),
        (second.json()["id"], True, None, "k1"),
        (keyless.json()["id"], True, None, None),
    ]
    assert {r["end_to_end_reference"] for r in stored} == {"E2E-payout-1"}


async def test_per_account_legacy_applies_only_to_the_listed_iban(account_rail, db):
    old_bank = transfer_body("old", beneficiary_iban=LEGACY_IBAN)
    new_bank = transfer_body("new")

    legacy = [await post(account_rail, "/v1/transfers", old_bank, "k1") for _ in range(2)]
    modern = [await post(account_rail, "/v1/transfers", new_bank, "k2") for _ in range(2)]
    keyless_old = await account_rail.post("/v1/transfers", json=old_bank)
    keyless_new = await account_rail.post("/v1/transfers", json=new_bank)

    assert [r.json()["legacy"] for r in legacy + modern] == [True, True, False, False]
    assert modern[1].headers["Idempotent-Replayed"] == "true"
    assert modern[1].json() == modern[0].json()
    assert keyless_old.status_code == 201 and keyless_new.status_code == 400
    stored = await rows(db, "fake_rail.transfer")
    assert [(r["reference"], r["legacy"], r["idempotency_key"], r["presented_key"]) for r in stored] == [
        ("old", True, None, "k1"),
        ("old", True, None, "k1"),
        ("new", False, "k2", "k2"),
        ("old", True, None, None),
    ]
    config = (await account_rail.get("/_admin/config")).json()
    assert config == {"legacy": False, "legacy_accounts": [LEGACY_IBAN], "cutoff": None}


async def test_a_legacy_account_matches_in_any_spelling_of_its_iban(rails_db_url, db):
    # Configured in print form, lower case; paid to in electronic and in print form.
    app = rail_module.create_app(rails_db_url, legacy_accounts=["gb33 bukb 2020 1555 5555 55"], cutoff=None)
    async for account_rail in _serve(app, "http://account-rail"):
        electronic = await post(account_rail, "/v1/transfers", transfer_body("a", beneficiary_iban=LEGACY_IBAN), "k1")
        printed = await post(
            account_rail, "/v1/transfers", transfer_body("b", beneficiary_iban="GB33 BUKB 2020 1555 5555 55"), "k2"
        )
        config = (await account_rail.get("/_admin/config")).json()

    assert electronic.json()["legacy"] and printed.json()["legacy"]
    assert [(r["reference"], r["legacy"], r["idempotency_key"]) for r in await rows(db, "fake_rail.transfer")] == [
        ("a", True, None),
        ("b", True, None),
    ]
    assert config["legacy_accounts"] == [LEGACY_IBAN]


def test_a_legacy_account_that_is_not_an_iban_refuses_the_rail(rails_db_url):
    with pytest.raises(ValueError, match="'GB00BUKB20201555555555' is not a valid IBAN"):
        rail_module.create_app(rails_db_url, legacy_accounts=["GB00BUKB20201555555555"])


async def test_a_legacy_transfer_cannot_be_probed_per_account_404_whole_rail_501(
    account_rail, legacy_rail, db
):
    await post(account_rail, "/v1/transfers", transfer_body("old", beneficiary_iban=LEGACY_IBAN), "k1")
    modern = await post(account_rail, "/v1/transfers", transfer_body("new"), "k2")
    await post(legacy_rail, "/v1/transfers", transfer_body("whole"), "k3")

    hidden = await account_rail.get("/v1/transfers/E2E-old")
    found = await account_rail.get("/v1/transfers/E2E-new")
    no_probe = await legacy_rail.get("/v1/transfers/E2E-whole")

    assert len(await rows(db, "fake_rail.transfer")) == 3  # all three exist
    assert hidden.status_code == 404 and hidden.json()["type"].endswith("/not-found")
    assert found.status_code == 200 and found.json() == modern.json()
    assert no_probe.status_code == 501 and no_probe.headers["content-type"] == PROBLEM
    assert no_probe.json()["type"].endswith("/no-status-probe")
    assert no_probe.json()["detail"] == "no status probe on a legacy rail"
    assert (await legacy_rail.get("/_admin/config")).json()["legacy"] is True


async def test_a_lost_response_on_a_legacy_rail_then_a_retry_pays_twice(legacy_rail, db):
    await set_faults(legacy_rail, {"action": "error_after"})

    lost = await post(legacy_rail, "/v1/transfers", transfer_body(), "k1")
    retry = await post(legacy_rail, "/v1/transfers", transfer_body(), "k1")

    assert lost.status_code == 500 and retry.status_code == 201
    stored = await rows(db, "fake_rail.transfer")
    assert [(r["status"], r["presented_key"]) for r in stored] == [
        ("accepted", "k1"),
        ("accepted", "k1"),
    ]


async def test_a_legacy_duplicate_appears_twice_on_the_statement(legacy_rail, db):
    first = await post(legacy_rail, "/v1/transfers", transfer_body(), "k1")
    second = await post(legacy_rail, "/v1/transfers", transfer_body(), "k1")

    statement = (await legacy_rail.get(f"/v1/statements/{utc_today()}")).json()

    assert [(e["transfer_id"], e["end_to_end_reference"]) for e in statement["entries"]] == [
        (first.json()["id"], "E2E-payout-1"),
        (second.json()["id"], "E2E-payout-1"),
    ]
    assert [r["booking_date"] for r in await rows(db, "fake_rail.transfer")] == [utc_today()] * 2


# --- Booking: cut-off and closed days -----------------------------------------


def close_day(rail, day) -> httpx.Response:
    return rail.post("/_admin/close-day", json={"date": str(day)})


async def test_closing_today_books_new_transfers_tomorrow_and_makes_today_final(
    rail, db, rails_db_url
):
    today = utc_today()
    tomorrow = today + timedelta(days=1)
    before = await post(rail, "/v1/transfers", transfer_body("before"), "k1")

    closed = await close_day(rail, today)
    after = await post(rail, "/v1/transfers", transfer_body("after"), "k2")

    assert closed.status_code == 200 and closed.json()["date"] == today.isoformat()
    stored = await rows(db, "fake_rail.transfer")
    assert [(r["reference"], r["booking_date"], r["value_date"]) for r in stored] == [
        ("before", today, today),
        ("after", tomorrow, tomorrow),
    ]
    assert after.json()["booking_date"] == tomorrow.isoformat()
    today_statement = (await rail.get(f"/v1/statements/{today}")).json()
    tomorrow_statement = (await rail.get(f"/v1/statements/{tomorrow}")).json()
    assert today_statement["final"] is True
    assert [e["transfer_id"] for e in today_statement["entries"]] == [before.json()["id"]]
    assert tomorrow_statement["final"] is False
    assert [e["transfer_id"] for e in tomorrow_statement["entries"]] == [after.json()["id"]]
    assert [d["date"] for d in (await rail.get("/_admin/closed-days")).json()["items"]] == [
        today.isoformat()
    ]
    assert await db.fetchval("SELECT day FROM fake_rail.closed_day") == today
    # Stored in PostgreSQL: a restarted rail still knows the day is closed.
    async for restarted in _serve(rail_module.create_app(rails_db_url, cutoff=None), "http://r"):
        assert (await restarted.get(f"/v1/statements/{today}")).json()["final"] is True


async def test_a_closed_days_statement_does_not_change_after_more_transfers(rail, account_rail, db):
    today = utc_today()
    await post(rail, "/v1/transfers", transfer_body("a"), "k1")
    await close_day(rail, today)
    closed = (await rail.get(f"/v1/statements/{today}")).json()

    await post(rail, "/v1/transfers", transfer_body("b"), "k2")
    await post(account_rail, "/v1/transfers", transfer_body("c", beneficiary_iban=LEGACY_IBAN), "k3")
    await post(rail, "/v1/transfers", transfer_body("a"), "k1")  # a replay
    later = (await rail.get(f"/v1/statements/{today}")).json()

    assert later == closed
    assert closed["final"] is True and len(closed["entries"]) == 1
    assert [r["booking_date"] for r in await rows(db, "fake_rail.transfer")] == [
        today,
        today + timedelta(days=1),
        today + timedelta(days=1),
    ]


async def test_closing_a_day_is_idempotent_and_closing_a_future_day_moves_the_calendar_on(rail, db):
    today = utc_today()

    too_far = await close_day(rail, today + timedelta(days=32))
    malformed = await rail.post("/_admin/close-day", json={"date": "tomorrow"})
    first = await close_day(rail, today - timedelta(days=3))
    again = await close_day(rail, today - timedelta(days=3))

    assert too_far.status_code == 400 and too_far.headers["content-type"] == PROBLEM
    assert too_far.json()["type"].endswith("/future-day")
    assert malformed.status_code == 400 and malformed.json()["type"].endswith("/invalid-date")
    assert first.status_code == again.status_code == 200 and again.json() == first.json()
    assert [r["day"] for r in await db.fetch("SELECT day FROM fake_rail.closed_day")] == [
        today - timedelta(days=3)
    ]

    assert (await close_day(rail, today + timedelta(days=2))).status_code == 200
    closed = [r["day"] for r in await db.fetch("SELECT day FROM fake_rail.closed_day ORDER BY day")]
    assert closed == [today - timedelta(days=3), today, today + timedelta(days=1), today + timedelta(days=2)]
    statement = (await rail.get(f"/v1/statements/{today + timedelta(days=1)}")).json()
    assert statement["final"] is True


def at(hh_mm: str, day: str = "2025-01-02", tz=UTC) -> datetime:
    return datetime.fromisoformat(f"{day}T{hh_mm}:00").replace(tzinfo=tz)


@pytest.mark.parametrize(
    ("accepted_at", "closed_days", "cutoff", "booked"),
    [
        (at("10:00"), set(), clock(23, 0), "2025-01-02"),
        (at("22:59"), set(), clock(23, 0), "2025-01-02"),
        (at("23:00"), set(), clock(23, 0), "2025-01-03"),  # at the cut-off: next day
        (at("23:59"), set(), clock(23, 0), "2025-01-03"),
        (at("23:59"), set(), None, "2025-01-02"),  # no cut-off
        (at("00:00"), set(), clock(0, 0), "2025-01-03"),  # a 00:00 cut-off: always next day
        (at("10:00"), {date(2025, 1, 2)}, clock(23, 0), "2025-01-03"),  # today closed
        # After the cut-off, and the next two days closed too.
        (at("23:30"), {date(2025, 1, 3), date(2025, 1, 4)}, clock(23, 0), "2025-01-05"),
        (at("10:00"), {date(2025, 1, 1)}, clock(23, 0), "2025-01-02"),  # past closures irrelevant
        # 00:30 at UTC+2 is 22:30 UTC the day before: before the cut-off.
        (at("00:30", tz=timezone(timedelta(hours=2))), set(), clock(23, 0), "2025-01-01"),
        (at("01:30", tz=timezone(timedelta(hours=2))), set(), clock(23, 0), "2025-01-02"),
    ],
)
def test_booking_date_for_applies_the_cutoff_and_skips_closed_days(
    accepted_at, closed_days, cutoff, booked
):
    assert rail_module.booking_date_for(accepted_at, closed_days, cutoff) == date.fromisoformat(booked)


def test_the_cutoff_option_takes_hh_mm_or_24_00_for_none():
    assert rail_module.parse_cutoff("17:30") == clock(17, 30)
    assert rail_module.parse_cutoff("24:00") is None
    for bad in ["25:00", "7:30", "17:30:00", "noon"]:
        with pytest.raises(ValueError):
            rail_module.parse_cutoff(bad)


async def test_the_default_cutoff_is_23_00_utc(rails_db_url):
    async for default in _serve(rail_module.create_app(rails_db_url), "http://default-rail"):
        config = (await default.get("/_admin/config")).json()
    assert config == {"legacy": False, "legacy_accounts": [], "cutoff": "23:00"}


async def test_a_transfer_whose_caller_timed_out_or_lost_the_answer_is_on_the_statement(rail, db):
    await set_faults(
        rail,
        {"action": "hang_after", "reference": "hung", "seconds": 30},
        {"action": "error_after", "reference": "lost"},
    )

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(post(rail, "/v1/transfers", transfer_body("hung"), "k1"), timeout=0.5)
    lost = await post(rail, "/v1/transfers", transfer_body("lost"), "k2")
    statement = (await rail.get(f"/v1/statements/{utc_today()}")).json()

    assert lost.status_code == 500
    stored = await rows(db, "fake_rail.transfer")
    assert [(r["reference"], r["status"], r["booking_date"]) for r in stored] == [
        ("hung", "accepted", utc_today()),
        ("lost", "accepted", utc_today()),
    ]
    assert [e["transfer_id"] for e in statement["entries"]] == [r["id"] for r in stored]



async def test_closing_a_day_waits_for_the_transfers_being_booked(rail, rails_db_url):
    # A booking in flight: the lock a transfer holds from reading the closed
    # days until it commits. The close must wait for it, or that transfer
    # could land on the day after it was closed. The close is seen waiting
    # in pg_locks (the booking lock of this database, asked for and not
    # granted; a lock on a bigint shows its low 32 bits as objid), so a close
    # that took no lock never shows up there and the wait below runs out.
    waiting = ("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objsubid = 1"
               " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
               " AND objid::bigint = hashtext('fake_rail.closed_day')::bigint & 4294967295")
    booking = await asyncpg.connect(asyncpg_dsn(rails_db_url))
    try:
        async with booking.transaction():
            await booking.execute(rail_module.BOOKING_LOCK.format("_shared"))
            closing = asyncio.create_task(close_day(rail, utc_today()))
            for _ in range(500):
                if await booking.fetchval(waiting) == 1:
                    break
                await asyncio.sleep(0.01)  # polling pg_locks, not waiting a guess
            else:
                pytest.fail(f"the close never waited for the booking's lock (done: {closing.done()})")
            assert not closing.done()
        assert (await asyncio.wait_for(closing, 5)).status_code == 200
    finally:
        await booking.close()
