"""IBANs (app/iban.py): validated by schwifty, and one spelling per account everywhere it is compared."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from app import iban
from app.config import Settings
from app.payments.models import PaymentRequest
from app.payments.submission import fingerprint
from app.rails.gateways import Rail

PAYMENTS = str(Path(sys.executable).parent / "payments")
ANY_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"  # never reached by these tests


@pytest.mark.parametrize(
    "text, electronic",
    [
        ("DE89370400440532013000", "DE89370400440532013000"),
        ("DE89 3704 0044 0532 0130 00", "DE89370400440532013000"),
        ("de89 3704 0044 0532 0130 00", "DE89370400440532013000"),
        (" gb82 WEST 1234 5698 7654 32 ", "GB82WEST12345698765432"),
    ],
)
def test_the_print_form_in_any_case_is_normalised_to_the_electronic_form(text, electronic):
    assert iban.normalise(text) == electronic


@pytest.mark.parametrize(
    "text, reason",
    [
        # Each has correct mod-97 check digits: the old hand-written check passed them all.
        ("XX46370400440532013000", "Unknown country-code 'XX'"),
        ("DE66370400440532013000123456789012", "length"),  # 34 characters: a German IBAN has 22
        ("GB93WES112345698765432", "BBAN structure"),  # a British bank code is four letters
        ("DE0537040044053201300A", "BBAN structure"),  # a German BBAN is all digits
        ("DE88370400440532013000", "checksum digits"),
        ("DE89\t370400440532013000", "only letters, digits and spaces"),
        ("DE89\u00a0370400440532013000", "only letters, digits and spaces"),
        ("ＤＥ89370400440532013000", "only letters, digits and spaces"),  # full-width letters
        ("DE89 " * 20, "longer than"),
        ("", "only letters, digits and spaces"),
    ],
)
def test_an_invalid_iban_is_refused_with_a_message_naming_what_is_wrong(text, reason):
    with pytest.raises(ValueError, match=reason):
        iban.normalise(text)


def test_a_retry_that_writes_the_iban_in_print_form_is_the_same_payment():
    body = {
        "amount": 1250, "currency": "EUR", "reference": "r", "card_token": "tok_visa",
        "beneficiary": {"name": "Ada", "iban": "DE89370400440532013000"},
    }
    printed = body | {"beneficiary": {"name": "Ada", "iban": "de89 3704 0044 0532 0130 00"}}
    requests = [PaymentRequest.model_validate(b) for b in (body, printed)]

    assert requests[1].beneficiary.iban == "DE89370400440532013000"  # what is stored and sent to the rail
    assert fingerprint(requests[0]) == fingerprint(requests[1])


def test_a_legacy_account_configured_in_print_form_is_still_treated_as_legacy():
    settings = Settings(database_url=ANY_POSTGRES, rail_legacy_accounts=" gb82 west 1234 5698 7654 32 ,DE89370400440532013000,")
    assert settings.legacy_accounts == {"GB82WEST12345698765432", "DE89370400440532013000"}

    rail = Rail(None, "http://rail", 1.0, 0, legacy_accounts=settings.legacy_accounts)
    request = PaymentRequest.model_validate({
        "amount": 1250, "currency": "EUR", "reference": "r", "card_token": "tok_visa",
        "beneficiary": {"name": "Old Bank Customer", "iban": "GB82 WEST 1234 5698 7654 32"},
    })
    # The rail client compares the payment row's IBAN, which is the request's, normalised.
    payment = SimpleNamespace(beneficiary_iban=request.beneficiary.iban)
    assert not rail.deduplicates(payment)  # sent once, never retried: a legacy rail pays twice
    assert rail.deduplicates(SimpleNamespace(beneficiary_iban="GB33BUKB20201555555555"))


def test_an_invalid_legacy_account_refuses_the_settings_naming_the_entry():
    with pytest.raises(ValidationError, match="'XX46370400440532013000' is not a valid IBAN"):
        Settings(database_url=ANY_POSTGRES, rail_legacy_accounts="GB82WEST12345698765432,XX46370400440532013000")


def test_payments_api_refuses_to_start_with_an_invalid_legacy_account():
    result = subprocess.run(
        [PAYMENTS, "api", "--port", "1"],  # port 1: if it did start, it could not serve
        env={"PATH": "/usr/bin:/bin", "DATABASE_URL": ANY_POSTGRES,
             "RAIL_LEGACY_ACCOUNTS": "GB82WEST12345698765432, DE88370400440532013000"},
        capture_output=True, text=True, timeout=60,
    )

    assert result.returncode == 2, result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert "RAIL_LEGACY_ACCOUNTS" in output and "'DE88370400440532013000' is not a valid IBAN" in output
    assert "Traceback" not in output
