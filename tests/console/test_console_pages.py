"""The operator console over HTTP: who may see it, what it shows, and that it never breaks.

What a person sees in a real browser is tested in test_console_in_a_browser.py;
here the same pages are read as HTML, which is faster and covers the refusals.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from app.console.routes import _ts
from devtools.processes import free_port
from tests.console.conftest import OPERATOR_TOKEN
from tests.support import charges, headers, payment_body

OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


async def pay(http, api_url: str, client, body: dict | None = None) -> httpx.Response:
    return await http.post(f"{api_url}/v1/payments", json=body or payment_body(),
                           headers=headers(client, str(uuid.uuid4())))


async def test_without_an_operator_token_the_console_is_disabled_not_open(http, stack):
    for path in ("/console", "/console/login", "/console/parked", f"/console/payments/{uuid.uuid4()}"):
        response = await http.get(stack.api + path)
        assert response.status_code == 404, path
        assert "console is disabled" in response.text
    assert (await http.post(stack.api + "/console/login", data={"token": "x" * 40})).status_code == 404


async def test_a_client_api_key_or_a_wrong_token_does_not_open_the_console(http, console_api, acme):
    for credentials in (acme.auth, {"Authorization": "Bearer " + "a" * 43}, {}):
        response = await http.get(console_api.url + "/console", headers=credentials)
        assert response.status_code == 401
        assert 'name="token"' in response.text, "a person is shown the login form"
        assert acme.api_key not in response.text


async def test_the_bearer_token_opens_the_console(http, console_api):
    response = await http.get(console_api.url + "/console", headers=OPERATOR)
    assert response.status_code == 200 and "Recent operations" in response.text
    assert "script-src" not in response.headers["Content-Security-Policy"]
    assert "default-src 'none'" in response.headers["Content-Security-Policy"], "no script may run"
    assert response.headers["Cache-Control"] == "no-store"


async def test_the_login_form_sets_an_httponly_strict_cookie_that_is_not_the_token(console_api):
    async with httpx.AsyncClient(base_url=console_api.url) as browser:
        wrong = await browser.post("/console/login", data={"token": "b" * 40, "next": "/console/parked"})
        assert wrong.status_code == 401 and "not the operator token" in wrong.text
        assert "set-cookie" not in wrong.headers

        response = await browser.post("/console/login", data={"token": OPERATOR_TOKEN, "next": "/console/parked"})
        assert response.status_code == 303 and response.headers["location"] == "/console/parked"
        cookie = response.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
        assert OPERATOR_TOKEN not in cookie
        assert (await browser.get("/console/parked")).status_code == 200  # the cookie opens it

        out = await browser.post("/console/logout")
        assert out.status_code == 303
        assert (await browser.get("/console/parked")).status_code == 401


@pytest.mark.parametrize("target", ["https://evil.example/", "//evil.example/console", "/v1/payments", "/console\\@evil"])
async def test_after_logging_in_the_console_sends_you_only_to_its_own_pages(console_api, target):
    async with httpx.AsyncClient(base_url=console_api.url) as browser:
        response = await browser.get("/console/login", params={"token": OPERATOR_TOKEN, "next": target})
    assert response.status_code == 303 and response.headers["location"] == "/console"


async def test_the_list_shows_each_operation_and_filters_by_state_client_and_parked(
    http, stack, console_api, db, acme, globex
):
    paid = await pay(http, console_api.url, acme)
    assert paid.status_code == 201
    other = await pay(http, console_api.url, globex)
    assert other.status_code == 201
    # One attempt allowed (MAX_ATTEMPTS=1) and a PSP that answers 500: parked at once.
    body = payment_body()
    (await http.put(stack.psp.url + "/_admin/faults", json={"faults": [
        {"action": "error_before", "status": 500, "reference": body["reference"], "times": None}]})).raise_for_status()
    parked = await pay(http, console_api.url, acme, body)
    assert parked.status_code == 202 and parked.json()["status"] == "indeterminate"

    everything = (await http.get(console_api.url + "/console", headers=OPERATOR)).text
    for payment in (paid, other, parked):
        assert f"/console/payments/{payment.json()['id']}" in everything
    assert "psp: HTTP 500" in everything, "the parked reason is shown"

    async def listed(**params: str) -> set[str]:
        page = await http.get(console_api.url + "/console", params=params, headers=OPERATOR)
        assert page.status_code == 200
        return {p.json()["id"] for p in (paid, other, parked) if f"/console/payments/{p.json()['id']}" in page.text}

    assert await listed(state="finished") == {paid.json()["id"], other.json()["id"]}
    assert await listed(parked="yes") == {parked.json()["id"]}
    assert await listed(parked="no") == {paid.json()["id"], other.json()["id"]}
    assert await listed(client=str(globex.id)) == {other.json()["id"]}
    assert await listed(recovery_point="EXT1_SENT") == {parked.json()["id"]}
    assert (await http.get(console_api.url + "/console", params={"state": "nonsense"}, headers=OPERATOR)).status_code == 400

    queue = (await http.get(console_api.url + "/console/parked", headers=OPERATOR)).text
    assert f"/console/payments/{parked.json()['id']}" in queue and f"/console/payments/{paid.json()['id']}" not in queue

    # A parked operation's next attempt is its next re-probe; a finished one has none.
    async def next_attempt(payment) -> str:
        html = (await http.get(f"{console_api.url}/console/payments/{payment.json()['id']}", headers=OPERATOR)).text
        return html.split('id="next-attempt">', 1)[1].split("<", 1)[0]

    due = await db.fetchval("SELECT next_attempt_at FROM idempotency_key WHERE payment_id = $1",
                            uuid.UUID(parked.json()["id"]))
    assert await next_attempt(parked) == _ts(due)
    assert await next_attempt(paid) == "-"


async def test_the_operation_page_shows_the_timeline_the_balanced_ledger_and_the_rails_records(
    http, console_api, db, acme
):
    paid = await pay(http, console_api.url, acme)
    payment = await db.fetchrow("SELECT * FROM payment WHERE id = $1", uuid.UUID(paid.json()["id"]))

    page = await http.get(f"{console_api.url}/console/payments/{payment['id']}", headers=OPERATOR)

    assert page.status_code == 200
    html = page.text
    assert '<svg xmlns="http://www.w3.org/2000/svg" id="timeline"' in html
    for event in ("claimed", "charge succeeded", "transfer accepted"):
        assert f">{event}</text>" in html
    assert payment["psp_charge_key"][:16] in html, "the charge's derived key K1 is on the diagram"
    assert 'id="ledger-check">balanced<' in html
    [charge] = await charges(db, payment["reference"])
    assert charge["id"] == payment["psp_charge_id"]
    assert html.count("the same record") == 2, "the PSP's charge and the rail's transfer are the ones our row names"


async def test_every_value_on_a_page_is_escaped(http, console_api, acme):
    body = payment_body()
    body["beneficiary"]["name"] = '<script>alert("x")</script><img src=x onerror=alert(1)>'
    paid = await pay(http, console_api.url, acme, body)
    assert paid.status_code == 201

    html = (await http.get(f"{console_api.url}/console/payments/{paid.json()['id']}", headers=OPERATOR)).text

    assert "<script>" not in html and "<img src=x" not in html
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in html


async def test_a_rail_and_a_psp_that_do_not_answer_show_as_unavailable_never_a_500(http, processes, console_api, acme):
    paid = await pay(http, console_api.url, acme)
    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    blind = processes.api("api-console-blind", OPERATOR_TOKEN=OPERATOR_TOKEN, PSP_URL=nobody, RAIL_URL=nobody)

    page = await http.get(f"{blind.url}/console/payments/{paid.json()['id']}", headers=OPERATOR)

    assert page.status_code == 200
    assert page.text.count(">unavailable</span>") == 2
    assert 'id="ledger-check">balanced<' in page.text, "the rest of the page is there"


async def test_an_unknown_payment_is_a_404_page(http, console_api):
    for pid in (str(uuid.uuid4()), "not-a-uuid"):
        response = await http.get(f"{console_api.url}/console/payments/{pid}", headers=OPERATOR)
        assert response.status_code == 404 and "There is no payment" in response.text


async def test_the_reconciliation_page_lists_runs_and_breaks(http, console_api, db, acme):
    paid = await pay(http, console_api.url, acme)
    payment_id = uuid.UUID(paid.json()["id"])
    # A break as reconciliation records one (app/workers/reconciliation.py::_record_breaks).
    await db.execute(
        "INSERT INTO scheduled_run (job, window_start, state, counts, finished_at) "
        "VALUES ('reconcile-rail', '2026-11-30', 'finished', '{\"breaks\": 1, \"entries\": 3}', now())"
    )
    await db.execute(
        "INSERT INTO reconciliation_break (window_start, kind, end_to_end_reference, payment_id, details) "
        "VALUES ('2026-11-30', 'amount_mismatch', 'E2E-<b>', $1, '{\"entry\": {\"amount\": 1}}')",
        payment_id,
    )

    html = (await http.get(console_api.url + "/console/reconciliation", headers=OPERATOR)).text

    assert "breaks=1, entries=3" in html
    assert "amount_mismatch" in html and "E2E-&lt;b&gt;" in html
    assert f"/console/payments/{payment_id}" in html


async def test_the_list_pages_by_keyset_newest_first_with_no_row_twice_and_none_missed(http, console_api, acme, database_url):
    from sqlalchemy.ext.asyncio import create_async_engine

    from app.config import asyncpg_url
    from app.db.transaction import read
    from app.readmodel import queries

    paid = [(await pay(http, console_api.url, acme)).json()["id"] for _ in range(5)]
    engine = create_async_engine(asyncpg_url(database_url))
    try:
        seen, before = [], None
        while True:
            page = await read(engine, queries.operations, queries.Filters(), before=before, limit=2)
            seen += [str(r.payment_id) for r in page.rows]
            if page.older is None:
                break
            before = page.older
    finally:
        await engine.dispose()

    assert seen == list(reversed(paid)), "newest first, each once"


async def test_the_webhooks_page_and_the_operation_page_show_each_delivery_and_its_attempts(
    http, console_api, db, shop
):
    paid = await pay(http, console_api.url, shop)
    assert paid.status_code == 201
    payment_id = uuid.UUID(paid.json()["id"])
    event_id = await db.fetchval("SELECT id FROM event WHERE payment_id = $1", payment_id)
    # No worker runs beside this API: the event waits for its first attempt,
    # after the dispatcher's cursor, with no delivery row yet.
    html = (await http.get(console_api.url + "/console/webhooks?state=pending", headers=OPERATOR)).text
    assert '<dd id="first-count">1</dd>' in html and '<dd id="pending-count">0 ' in html
    assert '<dd id="dead-count">0</dd>' in html
    page = (await http.get(console_api.url + f"/console/payments/{payment_id}", headers=OPERATOR)).text
    assert "Events and webhooks" in page and str(event_id) in page and ">pending</span>" in page

    # What the dispatcher writes when a first attempt is refused and the
    # schedule allows no other (app/outbox/delivery.py, `move`): the delivery
    # row, dead, and its attempt; and the cursor past the event.
    await db.execute(
        "INSERT INTO webhook_delivery (event_id, client_id, state, attempts, last_status, last_error) "
        "VALUES ($1, $2, 'dead', 1, 500, 'HTTP 500')", event_id, shop.id,
    )
    await db.execute(
        "INSERT INTO webhook_attempt (event_id, attempt, url, finished_at, outcome, status_code, latency_ms, "
        "error_class, error) VALUES ($1, 1, $2, now(), 'dead', 500, 12.3, 'http_status', 'HTTP 500')",
        event_id, shop.webhook_url,
    )
    await db.execute("UPDATE webhook_cursor SET (written_by, event_id) = (SELECT written_by, id FROM event "
                     "WHERE id = $1)", event_id)

    html = (await http.get(console_api.url + "/console/webhooks", headers=OPERATOR)).text  # dead is the default
    assert '<dd id="dead-count">1</dd>' in html and str(event_id) in html and "HTTP 500" in html
    assert '<dd id="first-count">0</dd>' in html
    pending = (await http.get(console_api.url + "/console/webhooks?state=pending", headers=OPERATOR)).text
    assert str(event_id) not in pending and "No pending deliveries." in pending
    page = (await http.get(console_api.url + f"/console/payments/{payment_id}", headers=OPERATOR)).text
    assert ">dead</span>" in page and "#1 dead 500 http_status 12 ms" in page
    # An unknown state is not an error: the page falls back to the dead ones.
    assert (await http.get(console_api.url + "/console/webhooks?state=<x>", headers=OPERATOR)).status_code == 200


async def test_a_returned_payout_shows_once_in_the_list_and_its_compensation_on_its_page(
    http, stack, console_api, db, acme
):
    from tests.support import payments_for, until

    body = payment_body()
    paid = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, str(uuid.uuid4())))
    assert paid.status_code == 201 and paid.json()["status"] == "succeeded"
    payment_id = paid.json()["id"]
    returned = await http.post(stack.rail.url + "/_admin/return", json={
        "end_to_end_reference": paid.json()["end_to_end_reference"], "reason_code": "AC04"})
    assert returned.status_code == 201, returned.text

    async def refunded() -> bool:
        return (await payments_for(db, body["reference"]))[0]["status"] == "refunded"

    await until(refunded, "the return to be applied and compensated")
    # Two key rows now name this payment: the client's and the compensation's.
    assert await db.fetchval("SELECT count(*) FROM idempotency_key WHERE payment_id = $1", uuid.UUID(payment_id)) == 2

    listed = (await http.get(console_api.url + "/console", headers=OPERATOR)).text
    assert listed.count(f'href="/console/payments/{payment_id}"') == 1, "the payment is listed once"
    page = await http.get(console_api.url + f"/console/payments/{payment_id}", headers=OPERATOR)
    assert page.status_code == 200
    assert "Compensation" in page.text and f"@return:{returned.json()['return_id']}" in page.text
    assert "payout_returned" in page.text and ">refunded</span>" in page.text


async def test_a_payments_refunds_show_on_its_page_each_with_its_timeline_and_what_is_left_to_refund(
    http, stack, console_api, db, acme
):
    paid = await http.post(f"{stack.api}/v1/payments", json=payment_body(amount=10_000),
                           headers=headers(acme, str(uuid.uuid4())))
    assert paid.status_code == 201 and paid.json()["status"] == "succeeded", paid.text
    payment_id = paid.json()["id"]
    refunds = f"{stack.api}/v1/payments/{payment_id}/refunds"
    # The first refund is pending at the PSP, then settles as failed: the
    # retry with the same key probes by K5 and records the failure.
    (await http.put(stack.psp.url + "/_admin/faults", json={"faults": [
        {"action": "pending", "operation": "refund", "seconds": 0, "settles_as": "failed"}]})).raise_for_status()
    failed_key = str(uuid.uuid4())
    body = {"amount": 3000, "reference": "rma-1", "reason": "parcel <lost>"}
    first = await http.post(refunds, json=body, headers=headers(acme, failed_key))
    assert first.status_code == 202 and first.json()["status"] == "pending", first.text
    failed = await http.post(refunds, json=body, headers=headers(acme, failed_key))
    assert failed.status_code == 201 and failed.json()["status"] == "failed", failed.text
    succeeded = await http.post(refunds, json={"amount": 2500, "reference": "rma-2"},
                                headers=headers(acme, str(uuid.uuid4())))
    assert succeeded.status_code == 201 and succeeded.json()["status"] == "succeeded", succeeded.text
    refused_key = str(uuid.uuid4())
    refused = await http.post(refunds, json={"amount": 9000, "reference": "rma-3"}, headers=headers(acme, refused_key))
    assert refused.status_code == 409 and refused.json()["type"].endswith("/refund-exceeds-payment")

    page = await http.get(f"{console_api.url}/console/payments/{payment_id}", headers=OPERATOR)

    assert page.status_code == 200
    html = page.text
    assert "<h2>Refunds</h2>" in html
    rows = {r["id"]: r for r in await db.fetch("SELECT * FROM refund WHERE payment_id = $1", uuid.UUID(payment_id))}
    assert set(map(str, rows)) == {failed.json()["id"], succeeded.json()["id"]}
    for refund_id, row in rows.items():
        row_html = html.split(f'id="refund-{refund_id}"')[1].split("</tr>")[0]
        assert f">{row['status']}</span>" in row_html and row["psp_refund_key"] not in row_html
        assert (row["failure_code"] or "-") in row_html
        # Each refund's key row drawn as a diagram of its own: the K5 call and how it ended.
        svg = html.split(f'id="timeline-refund-{refund_id}"')[1].split("</svg>")[0]
        assert "refund the card with K5" in svg and row["psp_refund_key"][:16] in svg
        assert f"{row['status']} · {row['psp_refund_id']}" in svg
    failed_svg = html.split(f'id="timeline-refund-{failed.json()["id"]}"')[1].split("</svg>")[0]
    assert "no applied answer: released, retried later" in failed_svg, "the pending answer, then the retry's probe"
    assert "probe by K5, then refund the card with K5 only if not found" in failed_svg
    assert "rma-1" in html and "parcel &lt;lost&gt;" in html and "30.00 EUR" in html and "25.00 EUR" in html
    # Only the succeeded refund holds money: 25.00 refunded, 75.00 left.
    assert '<dd id="refunded">25.00 EUR' in html and '<dd id="refundable">75.00 EUR' in html
    assert refused_key in html.split('id="refused-refunds"')[1] and "refused: refund-exceeds-payment" in html
    # Asked by K5, the PSP holds each refund as our row names it: with the charge and the transfer, four.
    assert html.count('<tr class="record client refund">') == 2 and html.count("the same record") == 4
    # A refund's key row is not a compensation, and the list still shows the payment once.
    assert "<h2>Compensation</h2>" not in html
    listed = (await http.get(console_api.url + "/console", headers=OPERATOR)).text
    assert listed.count(f'href="/console/payments/{payment_id}"') == 1
    assert failed_key not in listed and refused_key not in listed
