"""The PSP client's reading of refunds and of the settlement report, against a mock transport.

A client's refund may be pending at the PSP before it succeeds or fails:
pending is Settling (asked again later, never sent again), never Applied,
and never Unknown either. Our compensating refund keeps its narrower
allow-list. The settlement report is parsed whole, or refused whole with
ReportUnavailable.
"""

from __future__ import annotations

import json
from datetime import UTC, date, datetime

import httpx
import pytest
from pydantic import ValidationError

from app.rails.answers import ClientRefund, SettledRefund, SettlementReport
from app.rails.gateways import PSP, ReportUnavailable
from app.rails.outcomes import Applied, NotApplied, NotFound, Settling, Unknown

BASE = "http://psp.test"
DAY = date(2025, 1, 2)
NOT_FOUND = {"type": "https://fake-rails.example/problems/not-found", "title": "Not found", "status": 404}


class _Refund:
    psp_charge_id = "ch_1"
    amount_minor = 40
    reference = "refund-1"


class _Payment:
    id = "p"
    amount_minor = 100
    reference = "r"
    psp_charge_id = "ch_1"


def refund_body(status: str, **extra) -> dict:
    return {"id": "re_1", "object": "refund", "status": status, "failure_code": None, "amount": 40} | extra


class PSPAt:
    """A PSP client over httpx.MockTransport: every request answers `answer(request)`, and is kept."""

    def __init__(self, answer) -> None:
        self.requests: list[httpx.Request] = []

        def handle(request: httpx.Request) -> httpx.Response:
            self.requests.append(request)
            return answer(request)

        self.http = httpx.AsyncClient(transport=httpx.MockTransport(handle))
        self.psp = PSP(self.http, BASE, timeout=1.0, transient_retries=2)


@pytest.fixture
async def at():
    made: list[PSPAt] = []

    def make(answer) -> PSP:
        made.append(PSPAt(answer))
        return made[-1]

    yield make
    for m in made:
        await m.http.aclose()


def answers(status: int, body=None, **kw):
    return lambda request: httpx.Response(status, json=body, **kw)


# --- Sending ------------------------------------------------------------------


async def test_a_client_refund_posts_its_own_amount_and_reference_with_the_key(at):
    server = at(answers(201, refund_body("succeeded")))

    await server.psp.client_refund("K-refund", _Refund())

    (request,) = server.requests
    assert (request.method, request.url.path) == ("POST", "/v1/refunds")
    assert request.headers["Idempotency-Key"] == "K-refund"
    assert json.loads(request.content) == {"charge_id": "ch_1", "amount": 40, "reference": "refund-1"}


async def test_a_compensation_refund_sends_the_amount_it_is_given(at):
    server = at(answers(201, {"id": "re_1", "status": "succeeded"}))

    await server.psp.refund("K3", _Payment(), amount=60)

    assert json.loads(server.requests[0].content) == {"charge_id": "ch_1", "amount": 60, "reference": "r"}


@pytest.mark.parametrize(
    ("status", "failure_code"), [("succeeded", None), ("failed", "expired_or_canceled_card")]
)
async def test_a_final_refund_is_applied_with_its_status_on_send_and_on_probe(at, status, failure_code):
    body = refund_body(status, failure_code=failure_code)
    sent = await at(answers(201, body)).psp.client_refund("k", _Refund())
    found = await at(answers(200, body)).psp.find_client_refund("k")

    expected = Applied(ClientRefund(id="re_1", status=status, failure_code=failure_code, amount=40))
    assert sent == found == expected


async def test_a_pending_refund_is_settling_on_send_and_on_probe_never_sent_again(at):
    sending = at(answers(201, refund_body("pending")))
    sent = await sending.psp.client_refund("k", _Refund())
    found = await at(answers(200, refund_body("pending"))).psp.find_client_refund("k")

    assert sent == found == Settling("psp: refund pending")
    assert len(sending.requests) == 1  # not an inline retry's reason


async def test_a_pending_answer_without_an_id_is_unknown(at):
    body = refund_body("pending") | {"id": ""}
    assert isinstance(await at(answers(201, body)).psp.client_refund("k", _Refund()), Unknown)
    del body["id"]
    assert isinstance(await at(answers(200, body)).psp.find_client_refund("k"), Unknown)


@pytest.mark.parametrize("status", ["processing", "canceled", "PENDING", "refunded"])
async def test_an_undocumented_refund_status_is_unknown_on_send_and_on_probe(at, status):
    sent = await at(answers(201, refund_body(status))).psp.client_refund("k", _Refund())
    found = await at(answers(200, refund_body(status))).psp.find_client_refund("k")

    assert sent == found == Unknown(f"psp: undocumented status {status!r}")


@pytest.mark.parametrize("status", ["pending", "failed"])
async def test_our_compensation_refund_keeps_succeeded_as_its_only_answer(at, status):
    # Only a client refund knows pending and failed; a compensation that met
    # them is unknown, as before, and asked again.
    outcome = await at(answers(201, refund_body(status))).psp.refund("K3", _Payment(), amount=100)
    assert outcome == Unknown(f"psp: undocumented status {status!r}")


def test_pending_does_not_parse_as_a_client_refund():
    with pytest.raises(ValidationError):
        ClientRefund.model_validate(refund_body("pending"))


async def test_a_refused_client_refund_is_not_applied_and_a_missing_one_not_found(at):
    refused = {"type": "https://fake-rails.example/problems/refund-exceeds-charge", "status": 409}
    problem = {"headers": {"Content-Type": "application/problem+json"}}

    sent = await at(answers(409, refused, **problem)).psp.client_refund("k", _Refund())
    missing = await at(answers(404, NOT_FOUND, **problem)).psp.find_client_refund("k")
    broken = await at(answers(502)).psp.find_client_refund("k")

    assert sent == NotApplied("psp: refused (HTTP 409)")
    assert missing == NotFound()
    assert isinstance(broken, Unknown)


async def test_the_probe_asks_by_idempotency_key(at):
    server = at(answers(200, refund_body("succeeded")))
    await server.psp.find_client_refund("K-refund")
    (request,) = server.requests
    assert (request.method, request.url.path, request.url.params["idempotency_key"]) == (
        "GET", "/v1/refunds", "K-refund",
    )


# --- The settlement report ----------------------------------------------------


def line(**overrides) -> dict:
    return {
        "refund_id": "re_1", "idempotency_key": "K-refund", "charge_id": "ch_1", "amount": 40,
        "currency": "EUR", "status": "failed", "failure_code": "expired_or_canceled_card",
        "settled_at": "2025-01-02T10:00:02.123456Z",
    } | overrides


def report(*lines: dict, final: bool = True) -> dict:
    return {"date": DAY.isoformat(), "final": final, "refunds": list(lines)}


async def test_the_settlement_report_is_parsed(at):
    server = at(answers(200, report(line(), line(refund_id="re_2", status="succeeded", failure_code=None))))

    parsed = await server.psp.settlement_report(DAY)

    assert server.requests[0].url.path == "/v1/settlements/2025-01-02"
    assert parsed == SettlementReport(
        date=DAY,
        final=True,
        refunds=[
            SettledRefund(
                refund_id="re_1", idempotency_key="K-refund", charge_id="ch_1", amount=40, currency="EUR",
                status="failed", failure_code="expired_or_canceled_card",
                settled_at=datetime(2025, 1, 2, 10, 0, 2, 123456, tzinfo=UTC),
            ),
            SettledRefund(
                refund_id="re_2", idempotency_key="K-refund", charge_id="ch_1", amount=40, currency="EUR",
                status="succeeded", failure_code=None,
                settled_at=datetime(2025, 1, 2, 10, 0, 2, 123456, tzinfo=UTC),
            ),
        ],
    )


def _timeout(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadTimeout("slow", request=request)


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (_timeout, "psp: timed out"),
        (answers(500), "psp: settlement report answered HTTP 500"),
        (answers(404, NOT_FOUND), "psp: settlement report answered HTTP 404"),
        (lambda r: httpx.Response(200, text="<html>"), "psp: malformed settlement report"),
        (answers(200, {"date": DAY.isoformat(), "refunds": []}), "psp: malformed settlement report"),
        # A pending refund is never on a report: a line that says so refuses the report.
        (answers(200, report(line(status="pending"))), "psp: malformed settlement report"),
        (answers(200, report(line(amount="40"))), "psp: malformed settlement report"),
        (answers(200, report() | {"final": "yes"}), "psp: malformed settlement report"),
        (answers(200, report() | {"date": "2025-01-03"}), "psp: settlement report for 2025-01-03, not 2025-01-02"),
    ],
    ids=["timeout", "500", "404", "not-json", "no-final", "pending-line", "amount-as-text", "final-as-text", "other-day"],
)
async def test_no_usable_settlement_report_raises_report_unavailable(at, answer, reason):
    with pytest.raises(ReportUnavailable) as raised:
        await at(answer).psp.settlement_report(DAY)
    assert str(raised.value) == reason
