"""The rail clients' decisions: every HTTP exchange becomes Applied, NotApplied, NotFound or Unknown.

respx stands in for the PSP here, on httpx's default transport, only for
sequences that are awkward to stage with a real server (a 503 then a 201).
The same classes against real sockets and the transport the service uses in
production are in test_rail_clients_on_the_wire.py.
"""

from __future__ import annotations

import httpx
import pytest
import respx

from app.rails.gateways import PSP
from app.rails.answers import Charge
from app.rails.outcomes import Applied, NotApplied, NotFound, Unknown

CHARGE = {"id": "ch_1", "status": "succeeded"}
NOT_FOUND = {"type": "https://fake-rails.example/problems/not-found", "title": "Not found", "status": 404}

BASE = "http://psp.test"


@pytest.fixture
async def psp():
    async with httpx.AsyncClient() as http:
        yield PSP(http, BASE, timeout=1.0, transient_retries=2)


class _Payment:
    id = "p"
    amount_minor = 100
    currency = "EUR"
    card_token = "tok_visa"
    reference = "r"
    psp_charge_id = "ch_1"


@respx.mock
async def test_a_201_is_applied(psp):
    respx.post(f"{BASE}/v1/charges").respond(201, json=CHARGE)
    assert await psp.charge("k1", _Payment()) == Applied(Charge(id="ch_1", status="succeeded"))


@respx.mock
async def test_the_derived_key_is_sent_as_the_idempotency_key(psp):
    route = respx.post(f"{BASE}/v1/charges").respond(201, json=CHARGE)
    await psp.charge("k1", _Payment())
    assert route.calls.last.request.headers["Idempotency-Key"] == "k1"


@respx.mock
async def test_a_timeout_is_unknown_never_a_failure(psp):
    respx.post(f"{BASE}/v1/charges").mock(side_effect=httpx.ReadTimeout("slow"))
    assert isinstance(await psp.charge("k1", _Payment()), Unknown)


@respx.mock
async def test_a_500_is_unknown_because_it_may_have_applied(psp):
    respx.post(f"{BASE}/v1/charges").respond(500)
    assert isinstance(await psp.charge("k1", _Payment()), Unknown)


@respx.mock
async def test_a_503_then_a_201_is_retried_inline_with_the_same_key(psp):
    route = respx.post(f"{BASE}/v1/charges")
    route.side_effect = [httpx.Response(503, headers={"Retry-After": "0"}), httpx.Response(201, json=CHARGE)]
    assert await psp.charge("k1", _Payment()) == Applied(Charge(id="ch_1", status="succeeded"))
    assert [c.request.headers["Idempotency-Key"] for c in route.calls] == ["k1", "k1"]


@respx.mock
async def test_429s_beyond_the_retry_budget_are_not_applied_never_a_result(psp):
    route = respx.post(f"{BASE}/v1/charges").respond(429, headers={"Retry-After": "0"})
    assert await psp.charge("k1", _Payment()) == NotApplied("psp: refused (HTTP 429)")
    assert route.call_count == 3


@respx.mock
async def test_a_probe_tells_found_from_not_found_from_unknown(psp):
    respx.get(f"{BASE}/v1/charges", params={"idempotency_key": "a"}).respond(200, json=CHARGE)
    respx.get(f"{BASE}/v1/charges", params={"idempotency_key": "b"}).respond(
        404, json=NOT_FOUND, headers={"Content-Type": "application/problem+json"}
    )
    respx.get(f"{BASE}/v1/charges", params={"idempotency_key": "c"}).respond(502)
    respx.get(f"{BASE}/v1/charges", params={"idempotency_key": "d"}).respond(404, text="<html>no such page</html>")
    assert await psp.find_charge("a") == Applied(Charge(id="ch_1", status="succeeded"))
    assert await psp.find_charge("b") == NotFound()
    assert isinstance(await psp.find_charge("c"), Unknown)
    # A bare 404 (a proxy's page, a wrong URL) says nothing about our charge.
    assert isinstance(await psp.find_charge("d"), Unknown)
