"""Development tooling, not the payment path: the one payment-body factory.

The body of a `POST /v1/payments` that the tests, the demos, the bench and
`make run`'s welcome (its curl command) send: 12.50 EUR charged to the
test card `tok_visa` and paid out to Ada Lovelace's IBAN. A dict, with
overrides; a caller that needs bytes encodes it (`json.dumps(...).encode()`).
The service never builds one: it receives them.
"""

from __future__ import annotations

import uuid
from typing import Any

IBAN = "DE89370400440532013000"


def payment_body(reference: str | None = None, **overrides: Any) -> dict[str, Any]:
    """A valid payment request; `reference` defaults to a fresh `order-…`, any field can be overridden."""
    return {
        "amount": 1250,
        "currency": "EUR",
        "reference": reference or f"order-{uuid.uuid4().hex[:10]}",
        "card_token": "tok_visa",
        "beneficiary": {"name": "Ada Lovelace", "iban": IBAN},
    } | overrides
