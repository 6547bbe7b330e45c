"""The OpenAPI UI works with no internet: /docs and /redoc load nothing from a CDN.

FastAPI's own pages load Swagger UI's and ReDoc's JavaScript and CSS from a
CDN, so on a machine with no internet /docs is a blank page. The service
serves them from assets that ship in the fastapi-offline package. And the
document they render says what the API does: the Idempotency-Key header,
the request example, the problem types, tags, and no FastAPI 422 shape where
the API answers problem+json.
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.usefixtures("stack")

ASSET = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']""")


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
async def test_the_docs_pages_load_every_asset_from_the_service_itself(http, stack, page):
    response = await http.get(stack.api + page)

    assert response.status_code == 200 and "text/html" in response.headers["content-type"]
    assets = ASSET.findall(response.text)
    assert assets, "the page loads its script and style"
    assert all(a.startswith("/") for a in assets), f"an asset from elsewhere: {assets}"
    assert "fonts.googleapis" not in response.text
    for asset in assets:
        served = await http.get(stack.api + asset)
        assert served.status_code == 200 and len(served.content) > 1000, asset


async def test_the_document_shows_the_key_header_the_example_and_the_problem_types(http, stack):
    document = (await http.get(stack.api + "/openapi.json")).json()
    create = document["paths"]["/v1/payments"]["post"]

    [key] = [p for p in create["parameters"] if p["name"] == "Idempotency-Key"]
    assert key["required"] and key["in"] == "header" and key["example"]
    assert document["components"]["schemas"]["PaymentRequest"]["examples"]
    assert "/problems/idempotency-key-reused" in document["info"]["description"]
    assert "application/problem+json" in create["responses"]["409"]["content"]
    assert {t for ops in document["paths"].values() for op in ops.values() for t in op.get("tags", [])} == {
        "payments", "refunds", "payment batches", "idempotency keys", "meta", "events", "rail",
    }
    refund = document["paths"]["/v1/payments/{payment_id}/refunds"]["post"]
    [key] = [p for p in refund["parameters"] if p["name"] == "Idempotency-Key"]
    assert key["required"] and key["example"]
    # Real answers as examples: a 201 that succeeded or failed, a 202 pending, each problem of a 409.
    assert set(refund["responses"]["201"]["content"]["application/json"]["examples"]) == {"succeeded", "failed"}
    assert set(refund["responses"]["202"]["content"]["application/json"]["examples"]) == {"pending"}
    assert set(refund["responses"]["409"]["content"]["application/problem+json"]["examples"]) == {
        "request-in-progress", "duplicate-refund", "refund-exceeds-payment", "payment-not-refundable",
    }
    assert document["components"]["schemas"]["RefundRequest"]["examples"]
    assert "HTTPValidationError" not in str(document), "the API answers problem+json, never FastAPI's 422 shape"
