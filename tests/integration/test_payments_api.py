"""The response matrix (docs/response-matrix.md), row by row, against real processes.

Each test drives the API over HTTP and then reads the evidence: the key row,
the payment row, the ledger, and the fake PSP's and rail's own tables. An HTTP
status alone proves nothing about money.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import datetime

import httpx
import pytest

from app.api.body_limit import MAX_BODY_BYTES
from app.api.http_protocol import HEAD_TIMEOUT_SECONDS, MAX_HEAD_BYTES
from app.idempotency.keys import derived_key, end_to_end_reference
from tests.support import (
    charges, claimed, headers, key_row, ledger, payment_body, payments_for, refunds, requests_at, transfers,
    unbalanced_payments, until,
)

pytestmark = pytest.mark.usefixtures("stack")
PROBLEM = "application/problem+json"


async def post(http, stack, client, key, body, api: str | None = None) -> httpx.Response:
    return await http.post(f"{api or stack.api}/v1/payments", json=body, headers=headers(client, key))


async def set_faults(http, service, *faults) -> None:
    (await http.put(service.url + "/_admin/faults", json={"faults": list(faults)})).raise_for_status()


async def test_a_new_payment_charges_once_pays_out_once_and_balances_the_ledger(http, stack, db, acme):
    key, body = str(uuid.uuid4()), payment_body()
    response = await post(http, stack, acme, key, body)

    assert response.status_code == 201, response.text
    paid = response.json()
    assert paid["status"] == "succeeded" and paid["fee"] == 43 and paid["net_amount"] == 1207
    assert "Idempotent-Replayed" not in response.headers

    row = await key_row(db, acme.id, key)
    assert row["state"] == "finished" and row["recovery_point"] == "finished"
    assert row["response_code"] == 201 and row["response_body"] == response.text
    assert row["lease_token"] is None

    [charge] = await charges(db, body["reference"])
    assert charge["idempotency_key"] == derived_key(acme.id, key, "ext1")
    assert charge["amount"] == 1250 and charge["status"] == "succeeded"
    [transfer] = await transfers(db, body["reference"])
    assert transfer["idempotency_key"] == derived_key(acme.id, key, "ext2")
    assert transfer["end_to_end_reference"] == end_to_end_reference(acme.id, key) == paid["end_to_end_reference"]
    assert transfer["amount"] == 1207 and transfer["status"] == "accepted"

    assert await ledger(db, uuid.UUID(paid["id"])) == [
        ("charge_captured", "psp_receivable", 1250, 0),
        ("charge_captured", "beneficiary_payable", 0, 1207),
        ("charge_captured", "fee_revenue", 0, 43),
        ("payout_sent", "beneficiary_payable", 1207, 0),
        ("payout_sent", "rail_settlement", 0, 1207),
    ]
    assert await unbalanced_payments(db) == []


@pytest.mark.parametrize("first_api, replay_api", [(0, 1), (1, 0)], ids=["replayed-by-the-route", "replayed-by-the-shortcut"])
async def test_a_retry_replays_the_stored_response_byte_for_byte(http, stack, db, acme, first_api, replay_api):
    # stack.apis[0] answers replays with the replay shortcut, stack.apis[1]
    # (REPLAY_SHORTCUT=false) through the route: the same bytes either way.
    key, body = str(uuid.uuid4()), payment_body()
    first = await post(http, stack, acme, key, body, api=stack.apis[first_api].url)
    again = await post(http, stack, acme, key, body, api=stack.apis[replay_api].url)

    assert first.status_code == again.status_code == 201
    assert again.content == first.content
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len(await charges(db, body["reference"])) == 1
    assert len(await transfers(db, body["reference"])) == 1
    assert len(await payments_for(db, body["reference"])) == 1


async def test_a_retry_while_the_first_attempt_is_in_flight_gets_409_with_retry_after(http, stack, db, acme):
    key, body = str(uuid.uuid4()), payment_body()
    await set_faults(http, stack.psp, {"action": "delay", "reference": body["reference"], "seconds": 1.5})
    first = asyncio.create_task(post(http, stack, acme, key, body))
    # Synchronise on durable state: the first attempt has claimed the key.
    await claimed(db, acme.id, key)

    second = await post(http, stack, acme, key, body)

    assert second.status_code == 409
    assert second.headers["content-type"] == PROBLEM
    assert second.json()["type"] == "/problems/request-in-progress"
    assert int(second.headers["Retry-After"]) >= 1
    assert (await first).status_code == 201
    assert len(await charges(db, body["reference"])) == 1
    assert len(await transfers(db, body["reference"])) == 1


async def test_the_same_key_with_a_different_body_is_rejected_with_422_and_changes_nothing(http, stack, db, acme):
    key, body = str(uuid.uuid4()), payment_body()
    first = await post(http, stack, acme, key, body)
    before = await key_row(db, acme.id, key)

    reused = await post(http, stack, acme, key, body | {"amount": 9999})

    assert reused.status_code == 422
    assert reused.json()["type"] == "/problems/idempotency-key-reused"
    assert await key_row(db, acme.id, key) == before
    assert (await post(http, stack, acme, key, body)).content == first.content
    assert len(await charges(db, body["reference"])) == 1


async def test_a_different_body_is_rejected_even_while_the_first_attempt_is_in_flight(http, stack, db, acme):
    key, body = str(uuid.uuid4()), payment_body()
    await set_faults(http, stack.psp, {"action": "delay", "reference": body["reference"], "seconds": 1.5})
    first = asyncio.create_task(post(http, stack, acme, key, body))
    await claimed(db, acme.id, key)

    reused = await post(http, stack, acme, key, body | {"currency": "GBP"})

    assert reused.status_code == 422
    assert (await first).status_code == 201
    assert [c["currency"] for c in await charges(db, body["reference"])] == ["EUR"]


async def test_a_missing_idempotency_key_is_400_and_stores_nothing(http, stack, db, acme):
    response = await post(http, stack, acme, None, payment_body())

    assert response.status_code == 400
    assert response.headers["content-type"] == PROBLEM
    assert response.json()["type"] == "/problems/idempotency-key-missing"
    assert await db.fetchval("SELECT count(*) FROM idempotency_key") == 0
    assert await db.fetchval("SELECT count(*) FROM payment") == 0


@pytest.mark.parametrize(
    "bad_key",
    ["", "a" * 256, "has space", "semi;colon", "ключ".encode(), '"unterminated', '""', "new\\nline",
     '"a\\qb"', '"abc";v=1', '"abc"def'],
)
async def test_an_invalid_idempotency_key_is_400_and_stores_nothing(http, stack, db, acme, bad_key):
    response = await post(http, stack, acme, bad_key, payment_body())

    assert response.status_code == 400
    assert response.json()["type"] == "/problems/idempotency-key-invalid"
    assert await db.fetchval("SELECT count(*) FROM idempotency_key") == 0
    assert await db.fetchval("SELECT count(*) FROM fake_psp.charge") == 0


async def test_the_quoted_structured_field_form_is_the_same_key_as_the_bare_form(http, stack, db, acme):
    key, body = str(uuid.uuid4()), payment_body()
    bare = await post(http, stack, acme, key, body)
    quoted = await post(http, stack, acme, f'"{key}"', body)

    assert quoted.headers["Idempotent-Replayed"] == "true"
    assert quoted.content == bare.content
    assert len(await charges(db, body["reference"])) == 1


async def test_a_retry_with_the_iban_in_print_form_is_a_replay_and_the_rail_gets_the_electronic_form(
    http, stack, db, acme
):
    key, body = str(uuid.uuid4()), payment_body()
    printed = body | {"beneficiary": {"name": "Ada Lovelace", "iban": "de89 3704 0044 0532 0130 00"}}
    first = await post(http, stack, acme, key, printed)
    again = await post(http, stack, acme, key, body)

    assert first.status_code == 201, first.text
    assert again.headers["Idempotent-Replayed"] == "true" and again.content == first.content
    assert first.json()["beneficiary"]["iban"] == "DE89370400440532013000"
    [payment] = await payments_for(db, body["reference"])
    assert payment["beneficiary_iban"] == "DE89370400440532013000"
    [transfer] = await transfers(db, body["reference"])
    assert transfer["beneficiary_iban"] == "DE89370400440532013000"


async def test_a_retry_with_the_name_in_decomposed_unicode_is_a_replay_not_a_422(http, stack, db, acme):
    key = str(uuid.uuid4())
    composed = payment_body(beneficiary={"name": "Zo\u00eb Bront\u00eb", "iban": "DE89370400440532013000"})
    decomposed = composed | {"beneficiary": {"name": "Zoe\u0308 Bronte\u0308", "iban": "DE89370400440532013000"}}
    first = await post(http, stack, acme, key, decomposed)
    again = await post(http, stack, acme, key, composed)

    assert first.status_code == 201, first.text
    assert again.headers["Idempotent-Replayed"] == "true" and again.content == first.content
    [payment] = await payments_for(db, composed["reference"])
    assert payment["beneficiary_name"] == "Zo\u00eb Bront\u00eb"
    [transfer] = await transfers(db, composed["reference"])
    assert transfer["beneficiary_name"] == "Zo\u00eb Bront\u00eb"


async def test_a_name_with_a_bidirectional_override_is_400_and_stores_nothing(http, stack, db, acme):
    key = str(uuid.uuid4())
    body = payment_body(beneficiary={"name": "Ada \u202eecalevoL", "iban": "DE89370400440532013000"})
    response = await post(http, stack, acme, key, body)

    assert response.status_code == 400
    problem = response.json()
    assert problem["type"] == "/problems/invalid-request"
    assert problem["errors"][0]["location"] == ["body", "beneficiary", "name"]
    assert "U+202E" in problem["errors"][0]["message"]
    assert await key_row(db, acme.id, key) is None
    assert await charges(db, body["reference"]) == []


@pytest.mark.parametrize(
    "authorization", [None, "Bearer", "Bearer sk_test_not-a-real-key", "Basic dXNlcjpwYXNz", "Bearer " + "x" * 500]
)
async def test_a_missing_or_wrong_api_key_is_401_and_stores_nothing(http, stack, db, acme, authorization):
    request_headers = {"Idempotency-Key": str(uuid.uuid4())}
    if authorization:
        request_headers["Authorization"] = authorization
    response = await http.post(f"{stack.api}/v1/payments", json=payment_body(), headers=request_headers)

    assert response.status_code == 401
    assert response.json()["type"] == "/problems/unauthenticated"
    assert "WWW-Authenticate" in response.headers
    assert await db.fetchval("SELECT count(*) FROM idempotency_key") == 0


async def test_another_clients_payment_and_key_are_404_never_403(http, stack, db, acme, globex):
    key = str(uuid.uuid4())
    paid = (await post(http, stack, acme, key, payment_body())).json()

    for path in (f"/v1/payments/{paid['id']}", f"/v1/idempotency-keys/{key}"):
        assert (await http.get(stack.api + path, headers=acme.auth)).status_code == 200
        theirs = await http.get(stack.api + path, headers=globex.auth)
        assert theirs.status_code == 404
        assert theirs.json()["type"] == "/problems/not-found"
    assert (await http.get(f"{stack.api}/v1/payments/not-a-uuid", headers=acme.auth)).status_code == 404


@pytest.mark.parametrize("path, what", [
    ("/v1/payments/not-a-uuid", "payment"),
    ("/v1/payments/not-a-uuid/refunds", "payment"),
    ("/v1/refunds/not-a-uuid", "refund"),
    ("/v1/payment-batches/not-a-uuid", "batch"),
])
async def test_an_id_in_the_path_that_is_not_a_uuid_is_not_found(http, stack, acme, path, what):
    # Not a 400 or a 422: no id of ours looks like that, so it names nothing.
    response = await http.get(stack.api + path, headers=acme.auth)
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["type"] == "/problems/not-found"
    assert response.json()["detail"] == f"no such {what}"


async def test_two_clients_may_use_the_same_key_for_their_own_payments(http, stack, db, acme, globex):
    key = "order-42-attempt"
    mine = await post(http, stack, acme, key, payment_body())
    theirs = await post(http, stack, globex, key, payment_body())

    assert mine.status_code == theirs.status_code == 201
    assert "Idempotent-Replayed" not in theirs.headers
    assert mine.json()["id"] != theirs.json()["id"]
    assert await db.fetchval("SELECT count(*) FROM fake_psp.charge") == 2
    # Their derived keys differ too, so the PSP never sees one as a replay of the other.
    assert derived_key(acme.id, key, "ext1") != derived_key(globex.id, key, "ext1")


async def test_a_new_key_for_an_already_paid_reference_is_409_and_pays_nothing(http, stack, db, acme):
    body = payment_body()
    first = (await post(http, stack, acme, str(uuid.uuid4()), body)).json()
    second_key = str(uuid.uuid4())

    duplicate = await post(http, stack, acme, second_key, body)

    assert duplicate.status_code == 409
    problem = duplicate.json()
    assert problem["type"] == "/problems/duplicate-payment" and problem["payment_id"] == first["id"]
    assert await key_row(db, acme.id, second_key) is None
    assert len(await payments_for(db, body["reference"])) == 1
    assert len(await charges(db, body["reference"])) == 1


async def test_a_declined_order_may_be_tried_again_with_a_new_key_and_another_card(http, stack, db, acme):
    body = payment_body(card_token="tok_decline")
    declined = await post(http, stack, acme, str(uuid.uuid4()), body)
    retried = await post(http, stack, acme, str(uuid.uuid4()), body | {"card_token": "tok_visa"})

    assert declined.json()["status"] == "declined"
    assert retried.status_code == 201 and retried.json()["status"] == "succeeded"
    assert [p["status"] for p in await payments_for(db, body["reference"])] == ["declined", "succeeded"]
    # Paid now: the reference is held again.
    third = await post(http, stack, acme, str(uuid.uuid4()), body | {"card_token": "tok_visa"})
    assert third.status_code == 409 and third.json()["payment_id"] == retried.json()["id"]


async def test_a_declined_card_is_a_final_result_stored_and_replayed(http, stack, db, acme):
    key, body = str(uuid.uuid4()), payment_body(card_token="tok_decline")
    declined = await post(http, stack, acme, key, body)

    assert declined.status_code == 201
    payment = declined.json()
    assert payment["status"] == "declined"
    assert payment["failure"]["stage"] == "charge" and payment["failure"]["code"] == "card_declined"
    replay = await post(http, stack, acme, key, body)
    assert replay.content == declined.content and replay.headers["Idempotent-Replayed"] == "true"
    assert (await key_row(db, acme.id, key))["state"] == "finished"
    assert [c["status"] for c in await charges(db, body["reference"])] == ["declined"]
    assert await transfers(db, body["reference"]) == []
    assert await ledger(db, uuid.UUID(payment["id"])) == []


async def test_a_rail_rejection_is_compensated_by_exactly_one_refund(http, stack, db, acme):
    key, body = str(uuid.uuid4()), payment_body()
    await set_faults(http, stack.rail, {"action": "reject", "reference": body["reference"]})

    failed = await post(http, stack, acme, key, body)

    assert failed.status_code == 201
    payment = failed.json()
    assert payment["status"] == "failed" and payment["failure"]["stage"] == "payout"
    [charge] = await charges(db, body["reference"])
    [transfer] = await transfers(db, body["reference"])
    [refund] = await refunds(db, body["reference"])
    assert transfer["status"] == "rejected"
    assert refund["charge_id"] == charge["id"] and refund["amount"] == charge["amount"]
    assert refund["idempotency_key"] == derived_key(acme.id, key, "ext3")
    entries = await ledger(db, uuid.UUID(payment["id"]))
    assert {e[0] for e in entries} == {"charge_captured", "charge_refunded"}
    # Every account is back to zero: the customer paid nothing, we earned nothing.
    net: dict[str, int] = {}
    for _, account, debit, credit in entries:
        net[account] = net.get(account, 0) + debit - credit
    assert set(net.values()) == {0}
    replay = await post(http, stack, acme, key, body)
    assert replay.content == failed.content
    assert len(await refunds(db, body["reference"])) == 1


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b'\xff\xfe{"amount": 1}',
        b"[" * 16_000,  # under the body cap (row 14c), nested past any parser's patience
        b"[" * 8_000 + b"]" * 8_000,  # well-formed, but nested past json.loads' recursion limit
        b"[]",
        b"",
        json.dumps(payment_body(amount="1250")).encode(),
        json.dumps(payment_body(amount=-5)).encode(),
        json.dumps(payment_body(amount=12.5)).encode(),
        json.dumps(payment_body(amount=10)).encode(),
        json.dumps(payment_body(currency="XXX")).encode(),
        json.dumps(payment_body(beneficiary={"name": "A", "iban": "DE00370400440532013000"})).encode(),
        json.dumps(payment_body(beneficiary={"name": "A", "iban": "XX46370400440532013000"})).encode(),
        json.dumps(payment_body(beneficiary={"name": "A", "iban": "DE66370400440532013000123456789012"})).encode(),
        json.dumps(payment_body(card_token="4111111111111111")).encode(),
        json.dumps(payment_body(reference="x" * 65)).encode(),
        json.dumps(payment_body(unexpected=True)).encode(),
        json.dumps(payment_body(amount=10**30)).encode(),
    ],
)
async def test_a_malformed_body_is_a_400_problem_and_stores_nothing(http, stack, db, acme, content):
    response = await http.post(
        f"{stack.api}/v1/payments",
        content=content,
        headers=headers(acme, str(uuid.uuid4())) | {"Content-Type": "application/json"},
    )

    assert response.status_code == 400
    problem = response.json()
    assert response.headers["content-type"] == PROBLEM
    assert problem["type"] == "/problems/invalid-request" and problem["errors"]
    assert await db.fetchval("SELECT count(*) FROM idempotency_key") == 0
    assert await db.fetchval("SELECT count(*) FROM fake_psp.charge") == 0


async def test_a_20_mb_body_without_credentials_is_refused_413_before_it_is_read(http, stack, db):
    started = time.monotonic()
    response = await http.post(
        f"{stack.api}/v1/payments", content=b"{" + b" " * 20_000_000 + b"}",
        headers={"Content-Type": "application/json", "Idempotency-Key": str(uuid.uuid4())},
    )

    # 413, not 401 (authentication comes after) nor 400 (nothing was parsed).
    assert response.status_code == 413, response.text
    assert response.headers["content-type"] == PROBLEM
    assert response.json()["type"] == "/problems/payload-too-large"
    assert time.monotonic() - started < 10  # answered at once, not after buffering 20 MB
    assert await db.fetchval("SELECT count(*) FROM idempotency_key") == 0
    assert await db.fetchval("SELECT count(*) FROM payment") == 0


async def test_a_chunked_body_that_grows_past_the_cap_is_refused_413_and_stores_nothing(http, stack, db, acme):
    key, body = str(uuid.uuid4()), payment_body()

    async def chunks(pieces):
        for piece in pieces:
            yield piece

    # No Content-Length: the cap can only be enforced by counting what arrives.
    padded = json.dumps(body).encode()[:-1] + b"," + b" " * 32 * 1024 + b'"x": 1}'
    refused = await http.post(
        f"{stack.api}/v1/payments", content=chunks([padded[i : i + 1024] for i in range(0, len(padded), 1024)]),
        headers=headers(acme, key) | {"Content-Type": "application/json"},
    )
    assert "content-length" not in refused.request.headers
    assert refused.status_code == 413, refused.text
    assert refused.json()["type"] == "/problems/payload-too-large"
    assert await key_row(db, acme.id, key) is None
    assert await charges(db, body["reference"]) == []

    # A payment sent chunked, under the cap, is counted and let through.
    fine = await http.post(
        f"{stack.api}/v1/payments", content=chunks([json.dumps(body).encode()]),
        headers=headers(acme, key) | {"Content-Type": "application/json"},
    )
    assert fine.status_code == 201, fine.text
    assert len(await charges(db, body["reference"])) == 1


async def test_a_body_with_1500_unknown_fields_is_a_small_400_listing_20_of_them(http, stack, db, acme):
    key = str(uuid.uuid4())
    body = payment_body() | {f"f{i}": 0 for i in range(1500)}
    content = json.dumps(body, separators=(",", ":")).encode()
    assert len(content) <= MAX_BODY_BYTES  # the most unknown fields a body can carry, near enough

    response = await http.post(
        f"{stack.api}/v1/payments", content=content, headers=headers(acme, key) | {"Content-Type": "application/json"}
    )

    assert response.status_code == 400
    problem = response.json()
    assert problem["type"] == "/problems/invalid-request"
    assert len(problem["errors"]) == 20 and problem["errors_omitted"] == 1500 - 20
    assert len(response.content) < 4096
    assert await key_row(db, acme.id, key) is None


async def _raw_exchange(api: str, request: bytes, wait: float) -> bytes:
    """Send raw bytes to the API and read until it closes; b"" for a reset. Fails after `wait` seconds."""
    host, port = api.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), wait)
    except ConnectionError:
        return b""  # closed on us while we were still sending: refused, not hung
    finally:
        writer.close()


def _raw_payment(client, key: str, body: bytes, padding: int) -> bytes:
    """A whole POST /v1/payments, head and body in one write, with a header of `padding` bytes."""
    return (
        f"POST /v1/payments HTTP/1.1\r\nHost: api\r\nAuthorization: Bearer {client.api_key}\r\n"
        f"Idempotency-Key: {key}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n"
    ).encode() + b"X-Padding: " + b"a" * padding + b"\r\n\r\n" + body


async def test_a_100_kb_header_is_refused_431_not_read_into_memory(http, stack, db, acme):
    key, body = str(uuid.uuid4()), json.dumps(payment_body()).encode()

    # httptools alone would parse the header, however long, and serve the request.
    answer = await _raw_exchange(stack.api, _raw_payment(acme, key, body, 100_000), wait=15)

    assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    if answer:
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["type"] == "/problems/request-header-too-large"
    assert await key_row(db, acme.id, key) is None
    assert await db.fetchval("SELECT count(*) FROM fake_psp.charge") == 0

    # Just under the cap, with a body just under its own, in one write: served.
    # (The body's bytes are not counted as head.)
    near_cap = payment_body() | {"beneficiary": {"name": "A" * 140, "iban": "DE89370400440532013000"}}
    body = json.dumps(near_cap).encode().replace(b", ", b"," + b" " * (MAX_BODY_BYTES - 600), 1)
    answer = await _raw_exchange(stack.api, _raw_payment(acme, key, body, MAX_HEAD_BYTES - 500), wait=30)
    assert answer.startswith(b"HTTP/1.1 201 "), answer[:300]
    assert len(await charges(db, near_cap["reference"])) == 1


async def test_a_client_that_sends_its_headers_too_slowly_is_answered_408_and_cut_off(stack):
    # Half a request line and a header, then nothing: without a deadline the
    # connection would be held open for as long as the client liked.
    started = time.monotonic()
    answer = await _raw_exchange(stack.api, b"POST /v1/payments HTTP/1.1\r\nHost: api\r\n", wait=HEAD_TIMEOUT_SECONDS + 10)

    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["type"] == "/problems/request-timeout"
    assert HEAD_TIMEOUT_SECONDS - 1 < time.monotonic() - started < HEAD_TIMEOUT_SECONDS + 10


async def test_a_lost_rail_response_is_recovered_by_the_inline_probe_without_a_second_transfer(http, stack, db, acme):
    key, body = str(uuid.uuid4()), payment_body()
    await set_faults(http, stack.rail, {"action": "error_after", "reference": body["reference"]})

    response = await post(http, stack, acme, key, body)

    assert response.status_code == 201 and response.json()["status"] == "succeeded"
    assert len(await transfers(db, body["reference"])) == 1


async def test_an_unknown_outcome_answers_202_and_a_retry_completes_it_once(http, stack, db, acme):
    key, body = str(uuid.uuid4()), payment_body()
    # The PSP answers 500 before applying: we cannot know that, so it is unknown.
    await set_faults(
        http, stack.psp, {"action": "error_before", "status": 500, "reference": body["reference"]}
    )

    pending = await post(http, stack, acme, key, body)

    assert pending.status_code == 202
    assert pending.headers["Location"] == f"/v1/payments/{pending.json()['id']}"
    row = await key_row(db, acme.id, key)
    assert row["state"] == "started" and row["recovery_point"] == "EXT1_SENT" and row["lease_token"] is None
    shown = (await http.get(stack.api + pending.headers["Location"], headers=acme.auth)).json()
    assert shown["status"] == "processing"
    waiting = (await http.get(f"{stack.api}/v1/idempotency-keys/{key}", headers=acme.auth)).json()
    assert datetime.fromisoformat(waiting["next_attempt_at"]) == row["next_attempt_at"], "the worker's next try"

    finished = await post(http, stack, acme, key, body)

    assert finished.status_code == 201 and finished.json()["status"] == "succeeded"
    assert finished.json()["id"] == pending.json()["id"]
    assert len(await charges(db, body["reference"])) == 1
    assert len(await transfers(db, body["reference"])) == 1
    assert (await key_row(db, acme.id, key))["attempts"] == 2


async def test_the_key_endpoint_shows_the_state_machine_and_its_timeline(http, stack, db, acme):
    key = str(uuid.uuid4())
    await post(http, stack, acme, key, payment_body())

    view = (await http.get(f"{stack.api}/v1/idempotency-keys/{key}", headers=acme.auth)).json()

    assert view["state"] == "finished" and view["attempts"] == 1
    assert view["next_attempt_at"] is None, "nothing is left to try"
    assert [e["recovery_point"] for e in view["timeline"]] == ["EXT1_SENT", "EXT2_SENT", "finished"]


async def test_no_transaction_is_held_open_while_the_psp_is_called(http, stack, db, acme):
    key, body = str(uuid.uuid4()), payment_body()
    await set_faults(http, stack.psp, {"action": "delay", "reference": body["reference"], "seconds": 1.5})
    first = asyncio.create_task(post(http, stack, acme, key, body))
    await claimed(db, acme.id, key)

    async def charge_sent() -> bool:
        return ("POST", "/v1/charges") in await requests_at(db, "psp", reference=body["reference"])

    await until(charge_sent, "the charge to reach the PSP")
    # The API is now waiting on the PSP. Had it kept its transaction open, its
    # session would show as "idle in transaction" (holding the key row's locks).
    in_transaction = await db.fetch(
        "SELECT application_name, query FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'"
    )

    assert in_transaction == []
    assert not first.done()
    assert (await first).status_code == 201


async def test_a_timeout_is_answered_202_and_a_charge_that_lands_later_is_found_not_repeated(http, stack, db, acme):
    key, body = str(uuid.uuid4()), payment_body()
    # The PSP holds the charge for 3 s before applying it; we give up after 2 s
    # (PSP_TIMEOUT_SECONDS in the test stack), and our inline probe finds
    # nothing yet: the outcome is genuinely unknown.
    await set_faults(http, stack.psp, {"action": "delay", "reference": body["reference"], "seconds": 3})

    pending = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))

    assert pending.status_code == 202 and pending.json()["status"] == "processing"
    row = await key_row(db, acme.id, key)
    assert row["recovery_point"] == "EXT1_SENT" and row["lease_token"] is None, "released, not failed"
    assert row["last_error"] == "psp: timed out", "a short classified reason"
    for _ in range(200):  # the PSP applies it late, as real ones do (at most 10 s here)
        if await charges(db, body["reference"]):
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("the delayed charge never landed at the PSP")

    finished = await post(http, stack, acme, key, body)

    assert finished.status_code == 201 and finished.json()["status"] == "succeeded"
    assert len(await charges(db, body["reference"])) == 1, "the probe found the late charge: no second one"
    assert len(await transfers(db, body["reference"])) == 1


async def test_a_429_before_anything_was_applied_is_retried_inline_with_the_same_key(http, stack, db, acme):
    key, body = str(uuid.uuid4()), payment_body()
    await set_faults(http, stack.psp, {"action": "rate_limit", "reference": body["reference"]})

    response = await post(http, stack, acme, key, body)

    assert response.status_code == 201 and response.json()["status"] == "succeeded"
    [charge] = await charges(db, body["reference"])
    assert charge["idempotency_key"] == derived_key(acme.id, key, "ext1")
    assert (await key_row(db, acme.id, key))["attempts"] == 1, "no release, no takeover: one attempt"
