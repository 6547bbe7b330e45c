"""The rail clients' error taxonomy: every HTTP exchange becomes Applied, NotFound or Unknown.

respx stands in for the PSP here only to produce failures that are awkward to
stage with a real server (a read timeout at an exact point, a 503 then a 201).
"""

from __future__ import annotations

import httpx
import pytest
import respx

from app.rails.client import PSP
from app.rails.outcomes import Applied, NotFound, Unknown

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
    respx.post(f"{BASE}/v1/charges").respond(201, json={"id": "ch_1", "status": "succeeded"})
    assert await psp.charge("k1", _Payment()) == Applied({"id": "ch_1", "status": "succeeded"})


@respx.mock
async def test_the_derived_key_is_sent_as_the_idempotency_key(psp):
    route = respx.post(f"{BASE}/v1/charges").respond(201, json={"id": "ch_1"})
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
    route.side_effect = [httpx.Response(503, headers={"Retry-After": "0"}), httpx.Response(201, json={"id": "ch_1"})]
    assert await psp.charge("k1", _Payment()) == Applied({"id": "ch_1"})
    assert [c.request.headers["Idempotency-Key"] for c in route.calls] == ["k1", "k1"]


@respx.mock
async def test_429s_beyond_the_retry_budget_are_unknown_not_stored_as_final(psp):
    route = respx.post(f"{BASE}/v1/charges").respond(429, headers={"Retry-After": "0"})
    assert isinstance(await psp.charge("k1", _Payment()), Unknown)
    assert route.call_count == 3


@respx.mock
async def test_a_probe_tells_found_from_not_found_from_unknown(psp):
    respx.get(f"{BASE}/v1/charges", params={"idempotency_key": "a"}).respond(200, json={"id": "ch_1"})
    respx.get(f"{BASE}/v1/charges", params={"idempotency_key": "b"}).respond(404)
    respx.get(f"{BASE}/v1/charges", params={"idempotency_key": "c"}).respond(502)
    assert await psp.find_charge("a") == Applied({"id": "ch_1"})
    assert await psp.find_charge("b") == NotFound()
    assert isinstance(await psp.find_charge("c"), Unknown)
