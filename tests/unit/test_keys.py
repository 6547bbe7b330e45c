"""Key validation, fingerprints and derived keys: pure functions, no database."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.idempotency.keys import (
    InvalidIdempotencyKey, derived_key, end_to_end_reference, parse_idempotency_key, request_fingerprint,
)
from app.payments.models import PaymentRequest, fee_for
from app.payments.submission import fingerprint


@pytest.mark.parametrize(
    "raw, key",
    [
        ("8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        ('"8e03978e-40d5-43e8-bc93-6894a57f9324"', "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        (' \t"invoice-2026-0042" ', "invoice-2026-0042"),
        ("\tinvoice-2026-0042 ", "invoice-2026-0042"),
        ("invoice-2026-0042", "invoice-2026-0042"),
        ("a", "a"),
        ("x" * 255, "x" * 255),
        ("base64+/=", "base64+/="),
    ],
)
def test_valid_keys_are_accepted_bare_or_quoted(raw, key):
    assert parse_idempotency_key(raw) == key


@pytest.mark.parametrize(
    "raw",
    [
        "", '""', "x" * 256, "a b", "a;b", "ключ", "a\x00b", '"a', "a,b", "{}",
        # Only spaces and tabs surround a field value; anything else is part of it.
        "abc\x0b", "abc\xa0", "\x1cabc",
    ],
)
def test_invalid_keys_are_refused(raw):
    with pytest.raises(InvalidIdempotencyKey):
        parse_idempotency_key(raw)


@pytest.mark.parametrize(
    "raw, why",
    [
        ('"abc', "closing DQUOTE"),  # unterminated
        ('"a\\qb"', "Backslash before disallowed character"),  # \q is no escape
        ('"abc"def', "Trailing characters"),
        ('"abc", "def"', "Trailing characters"),  # two keys
        ('"abc";v=1', "no parameters"),
        ('"kl\u00fcssel"', "printable ASCII"),
    ],
)
def test_a_quoted_key_that_is_not_one_structured_field_string_is_refused_saying_why(raw, why):
    with pytest.raises(InvalidIdempotencyKey, match=why):
        parse_idempotency_key(raw)


@pytest.mark.parametrize("raw", ['"ab\\"c"', '"a\\\\b"', '" abc"'])
def test_an_escape_or_a_space_inside_the_quotes_is_parsed_and_then_refused_as_outside_the_charset(raw):
    with pytest.raises(InvalidIdempotencyKey, match="characters from"):
        parse_idempotency_key(raw)


def test_the_fingerprint_ignores_json_layout_but_not_content():
    a = {"amount": 100, "currency": "EUR", "nested": {"x": 1, "y": 2}}
    b = {"nested": {"y": 2, "x": 1}, "currency": "EUR", "amount": 100}
    assert request_fingerprint("POST", "/v1/payments", a) == request_fingerprint("post", "/v1/payments", b)
    assert request_fingerprint("POST", "/v1/payments", a) != request_fingerprint("POST", "/v1/payments", a | {"amount": 101})
    assert request_fingerprint("POST", "/v1/payments", a) != request_fingerprint("POST", "/v1/other", a)


def test_derived_keys_are_deterministic_and_distinct_per_client_key_and_step():
    assert derived_key(1, "k", "ext1") == derived_key(1, "k", "ext1")
    keys = {derived_key(c, k, s) for c in (1, 2) for k in ("k", "k2") for s in ("ext1", "ext2", "ext3")}
    assert len(keys) == 12
    # No ambiguity from concatenation: (1, "1k") and (11, "k") are different operations.
    assert derived_key(1, "1k", "ext1") != derived_key(11, "k", "ext1")


def test_the_end_to_end_reference_is_deterministic_and_fits_iso_20022():
    ref = end_to_end_reference(7, "abc")
    assert ref == end_to_end_reference(7, "abc") != end_to_end_reference(8, "abc")
    assert len(ref) <= 35 and ref.isalnum()


def test_the_fee_is_integer_and_rounds_up():
    assert fee_for(1250) == 18 + 25  # 1.4% of 1250 is 17.5, rounded up to 18
    assert fee_for(10_000) == 140 + 25
    assert isinstance(fee_for(999), int)


def test_two_bodies_that_validate_to_the_same_payment_have_the_same_fingerprint():
    body = {
        "amount": 1250, "currency": "EUR", "reference": "r", "card_token": "tok_visa",
        "beneficiary": {"name": "Ada", "iban": "DE89370400440532013000"},
    }
    reordered = dict(reversed(list(body.items())))
    fp = [request_fingerprint("POST", "/v1/payments", PaymentRequest.model_validate(b).model_dump(mode="json")) for b in (body, reordered)]
    assert fp[0] == fp[1]


def _request(name: str, reference: str = "r") -> PaymentRequest:
    return PaymentRequest.model_validate({
        "amount": 1250, "currency": "EUR", "reference": reference, "card_token": "tok_visa",
        "beneficiary": {"name": name, "iban": "DE89370400440532013000"},
    })


def test_a_name_in_decomposed_unicode_is_the_same_payment_as_its_composed_form():
    composed, decomposed = _request("Zo\u00eb Bront\u00eb"), _request("Zoe\u0308 Bronte\u0308")

    assert decomposed.beneficiary.name == "Zo\u00eb Bront\u00eb"  # stored and sent to the rail in NFC
    assert fingerprint(decomposed) == fingerprint(composed)


def test_nfc_comes_before_the_length_limit():
    # 140 letters once composed, 280 code points as sent.
    assert _request("e\u0301" * 140).beneficiary.name == "\u00e9" * 140


@pytest.mark.parametrize(
    "name",
    [
        "Ada \u202eecalevoL",  # RIGHT-TO-LEFT OVERRIDE: displays "Ada Lovelace"
        "Ada \u2066Lovelace\u2069",  # an isolate
        "Ada\u200f",  # RIGHT-TO-LEFT MARK
        "Ada\x00", "Ada\x1b[31m", "Ada\x7f", "Ada\x85",  # C0, DEL, C1
        "Ada\u2028Lovelace",  # LINE SEPARATOR: a new line in a log
        "\ufeffAda",  # BOM
        "Ada\u00adLovelace",  # SOFT HYPHEN: invisible
    ],
)
def test_control_and_formatting_characters_in_a_name_are_refused(name):
    with pytest.raises(ValidationError, match="control and formatting characters are refused"):
        _request(name)


def test_the_joiners_that_scripts_need_are_kept():
    assert _request("\u0645\u06cc\u200c\u0631\u0648\u062f").beneficiary.name.count("\u200c") == 1  # Persian ZWNJ
