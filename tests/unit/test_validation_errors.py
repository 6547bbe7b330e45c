"""The 400 invalid-request answer (app/api/errors.py): its error list is bounded, however many errors a body has."""

from __future__ import annotations

import json

import pytest

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from app.api.errors import MAX_LISTED_ERRORS, validation_problem
from app.payments.models import PaymentRequest


def _errors_of(body: dict) -> RequestValidationError:
    try:
        PaymentRequest.model_validate(body)
    except ValidationError as exc:
        # What FastAPI hands the handler: the errors, located in the body.
        return RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()])
    raise AssertionError("the body validated")


def test_a_body_with_5000_unknown_fields_gets_a_small_answer_listing_the_first_20():
    body = {
        "amount": 1250, "currency": "EUR", "reference": "r", "card_token": "tok_visa",
        "beneficiary": {"name": "Ada", "iban": "DE89370400440532013000"},
    } | {f"unknown_{i}": i for i in range(5000)}

    response = validation_problem(_errors_of(body), "/v1/payments")

    problem = json.loads(response.body)
    assert response.status_code == 400 and problem["type"] == "/problems/invalid-request"
    assert len(problem["errors"]) == MAX_LISTED_ERRORS == 20
    assert problem["errors"][0] == {"location": ["body", "unknown_0"], "message": "Extra inputs are not permitted", "type": "extra_forbidden"}
    assert problem["errors_omitted"] == 5000 - 20
    assert len(response.body) < 4096  # without the cap: over 400 KB


def test_a_body_with_a_few_errors_lists_them_all_and_omits_nothing():
    response = validation_problem(_errors_of({"amount": "1250", "currency": "XXX"}), "/v1/payments")

    problem = json.loads(response.body)
    assert {tuple(e["location"]) for e in problem["errors"]} == {
        ("body", "amount"), ("body", "currency"), ("body", "reference"), ("body", "card_token"), ("body", "beneficiary"),
    }
    assert "errors_omitted" not in problem


def test_a_problem_extension_can_never_replace_a_standard_member():
    """A payment's status sent as `status` once replaced the HTTP status (409) in a refund's problem."""
    from app.problems import PAYMENT_NOT_REFUNDABLE, problem_body

    with pytest.raises(ValueError, match="status"):
        problem_body(PAYMENT_NOT_REFUNDABLE, "payment p is declined", status="declined")
    assert problem_body(PAYMENT_NOT_REFUNDABLE, "d", payment_status="declined")["status"] == 409
