"""What a return of a payout may do to the payment it names, decided before anything is written.

`returns._decide` is the allow-list of app/payments/returns.py: only a
payout we recorded as accepted, of this very transfer and amount, is
returned; a payment whose transfer outcome is not recorded yet is "too early"
(refused, redelivered later), and everything else is a break for a person.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from app.idempotency.keys import InvalidIdempotencyKey, parse_idempotency_key
from app.payments.models import Payment
from app.payments.returns import _decide, compensation_key, inbox_key
from app.rails.answers import ReturnLine, ReturnNotification

NOW = datetime(2026, 12, 1, tzinfo=UTC)
PAID = Payment(
    id=uuid.uuid4(), client_id=1, reference="order-1", amount_minor=1250, currency="EUR", fee_minor=43,
    net_minor=1207, card_token="tok_visa", beneficiary_name="Ada", beneficiary_iban="DE89370400440532013000",
    status="succeeded", end_to_end_reference="E2E1", psp_charge_key="k1", psp_charge_id="ch_1", decline_code=None,
    rail_transfer_key="k2", rail_transfer_id="tr_1", reject_reason=None, psp_refund_key=None, psp_refund_id=None,
    created_at=NOW, updated_at=NOW, payout_instructed_at=NOW,
)
LINE = ReturnLine(return_id="rt_1", transfer_id="tr_1", end_to_end_reference="E2E1", amount=1207,
                  currency="EUR", reason_code="AC04")


def test_a_return_of_the_payout_we_recorded_is_applied():
    assert _decide(PAID, LINE) == ("applied", "")


def test_a_return_naming_no_payment_is_unmatched():
    assert _decide(None, LINE)[0] == "unmatched"


@pytest.mark.parametrize("status", ["processing", "indeterminate"])
def test_a_return_before_the_transfer_outcome_is_recorded_is_too_early(status):
    assert _decide(replace(PAID, status=status, rail_transfer_id=None), LINE)[0] == "too_early"


@pytest.mark.parametrize("status", ["declined", "failed", "returned", "refunded"])
def test_a_return_of_a_payment_that_paid_nothing_out_or_came_back_already_is_unexpected(status):
    assert _decide(replace(PAID, status=status), LINE)[0] == "unexpected"


@pytest.mark.parametrize("change", [{"transfer_id": "tr_2"}, {"amount": 1250}, {"currency": "GBP"}])
def test_a_return_of_another_transfer_or_amount_is_unexpected(change):
    assert _decide(PAID, LINE.model_copy(update=change))[0] == "unexpected"


def test_an_unknown_reason_code_or_message_type_does_not_parse():
    body = {"id": "msg_1", "type": "transfer.returned", "data": LINE.model_dump()}
    assert ReturnNotification.model_validate(body).data == LINE
    with pytest.raises(ValueError):
        ReturnNotification.model_validate({**body, "data": {**body["data"], "reason_code": "ZZ99"}})
    with pytest.raises(ValueError):
        ReturnNotification.model_validate({**body, "type": "transfer.recalled"})


def test_the_notification_and_the_statement_line_meet_on_one_inbox_key_and_no_client_key_can_be_the_compensation():
    assert inbox_key("rt_1") == "return:rt_1"
    with pytest.raises(InvalidIdempotencyKey):
        parse_idempotency_key(compensation_key("rt_1"))
