"""A stored response has a documented maximum size, and no payment can reach it.

The key table keeps every final response, to replay it byte for byte: it
must never become a store of blobs, and a response must never be cut short
(a truncated replay is a different answer). The engine (app/machine/engine.py)
caps every stored response at MAX_STORED_RESPONSE_BYTES and refuses a larger
one as a bug; the database refuses it too (migration 0005). These tests show that the
largest response the API can produce is well inside the cap, and that the
guard refuses, rather than trims, one that is not.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from app.payments.models import MAX_AMOUNT_MINOR, Payment, PaymentRequest, fee_for
from app.machine.engine import MAX_STORED_RESPONSE_BYTES, StoredResponseTooLarge, storable
from app.payments.models import PaymentView
from app.rails.answers import Charge, Transfer


def largest_payment(status: str) -> Payment:
    """A payment with every field the response shows at its longest, as validation and the rails allow."""
    widest = "\U00010348"  # four bytes in UTF-8, a letter (so validation keeps it)
    request = PaymentRequest.model_validate({
        "amount": MAX_AMOUNT_MINOR, "currency": "EUR", "reference": "r" * 64, "card_token": "tok_visa",
        "beneficiary": {"name": widest * 140, "iban": "LC55HEMM000100010012001200023015"},  # 32, among the longest
    })
    longest_code = "x" * max(
        Charge.model_fields["decline_code"].metadata[0].max_length,
        Transfer.model_fields["reject_reason"].metadata[0].max_length,
    )
    now = datetime.now(UTC)
    fee = fee_for(request.amount)
    return Payment(
        id=uuid.uuid4(), client_id=2**62, reference=request.reference, amount_minor=request.amount,
        currency=request.currency, fee_minor=fee, net_minor=request.amount - fee, card_token=request.card_token,
        beneficiary_name=request.beneficiary.name, beneficiary_iban=request.beneficiary.iban, status=status,
        end_to_end_reference="E" * 35, psp_charge_key="k" * 64, psp_charge_id="c" * 100, decline_code=longest_code,
        rail_transfer_key="k" * 64, rail_transfer_id="t" * 100, reject_reason=longest_code,
        psp_refund_key="k" * 64, psp_refund_id="f" * 100, created_at=now, updated_at=now, payout_instructed_at=now,
    )


@pytest.mark.parametrize("status", ["succeeded", "declined", "failed"])
def test_the_largest_response_a_payment_can_have_is_well_inside_the_cap(status):
    body = storable(PaymentView.of(largest_payment(status)).body())

    assert len(body.encode()) <= MAX_STORED_RESPONSE_BYTES // 2, len(body.encode())


def test_a_response_over_the_cap_is_refused_whole_never_truncated():
    # Only a bug could build this (validation refuses such a name).
    oversized = replace(largest_payment("succeeded"), beneficiary_name="n" * MAX_STORED_RESPONSE_BYTES)

    with pytest.raises(StoredResponseTooLarge):
        storable(PaymentView.of(oversized).body())
