"""Pure functions on keys: the first thing a request meets after authentication.

The key is an untrusted, client-supplied string that becomes part of a primary
key, so it is validated at the edge (length and charset) before it reaches SQL.
The fingerprint is what lets us tell a genuine retry from a client that reused
a key for a different payment. Derived keys are what we present to the PSP and
the rail: deterministic, so a resumed attempt sends the very key a dead attempt
may already have sent, and the external system treats it as a replay.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import http_sf

MAX_KEY_LENGTH = 255
# UUIDs, ULIDs and most natural keys ("invoice-2026-0042") fit. Nothing that
# needs quoting, escaping or normalising: a key compares byte for byte.
KEY_CHARSET = r"A-Za-z0-9_.:~+/=-"
_KEY = re.compile(rf"[{KEY_CHARSET}]{{1,{MAX_KEY_LENGTH}}}")


class InvalidIdempotencyKey(ValueError):
    """The header is present but its value cannot be a key."""


def parse_idempotency_key(raw: str) -> str:
    """The key from an `Idempotency-Key` header value.

    The IETF draft defines the header as a structured-field String (RFC 9651),
    which is quoted (`"8e03978e-..."`); many clients send the bare value. Both
    are accepted and mean the same key, and the replay shortcut calls this
    same function, so the two paths always agree on what key a request has.

    Which form is which: a value that starts with a double quote is parsed as
    a structured-field item by http-sf, and must be a String with no
    parameters; anything else is the bare form. (A bare key is not a valid
    sf-string, and most are not valid sf-tokens either: a UUID starting with
    a digit is neither, so the bare form cannot go through the parser.) A
    quoted value the parser refuses, an unterminated quote, an escape other
    than `\"` or `\\`, a character outside printable ASCII, text after the
    closing quote, is refused here: a hand-rolled "strip the quotes" would
    take `"abc` or `"a"b"` for some other key. Either way the key itself must
    then be 1 to 255 characters from KEY_CHARSET, which has no quote or
    backslash, so an escaped character is never part of a key.
    """
    value = raw.strip(" \t")  # optional whitespace around a field value (RFC 9110)
    if value.startswith('"'):
        value = _sf_string(value)
    if not _KEY.fullmatch(value):
        raise InvalidIdempotencyKey(
            f"an Idempotency-Key is 1 to {MAX_KEY_LENGTH} characters from "
            f"[{KEY_CHARSET}]"
        )
    return value


def _sf_string(value: str) -> str:
    """The String in a quoted header value; InvalidIdempotencyKey if it is not exactly one."""
    if not value.isascii():
        raise InvalidIdempotencyKey("a quoted Idempotency-Key must be printable ASCII")
    try:
        item, parameters = http_sf.parse(value.encode("ascii"), tltype="item")
    except http_sf.StructuredFieldError as exc:
        raise InvalidIdempotencyKey(f"a quoted Idempotency-Key must be a structured-field string: {exc}") from None
    if not isinstance(item, str) or parameters:
        raise InvalidIdempotencyKey("a quoted Idempotency-Key must be a structured-field string with no parameters")
    return item


def canonical_json(value: Any) -> bytes:
    """One byte string per JSON value: sorted keys, no insignificant whitespace."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode()


def request_fingerprint(method: str, path: str, body: Any) -> bytes:
    """SHA-256 over what makes two requests "the same request".

    `body` is the validated request, so `{"amount": 100}` and `{ "amount":100 }`
    are the same payment while any change of amount, currency, reference or
    beneficiary is a different one.
    """
    digest = hashlib.sha256()
    digest.update(method.upper().encode() + b"\n" + path.encode() + b"\n")
    digest.update(canonical_json(body))
    return digest.digest()


def derived_key(client_id: int, key: str, step: str) -> str:
    """The idempotency key for one external step of one operation: H(client, key, step).

    The client id is part of it because keys are only unique per client; two
    clients' "req-001" must never share a key at the PSP.
    """
    material = f"{client_id}\x1f{key}\x1f{step}".encode()
    return hashlib.sha256(material).hexdigest()


def end_to_end_reference(client_id: int, key: str) -> str:
    """The payout's end-to-end reference: deterministic, and at most 35 characters.

    35 is the ISO 20022 limit for EndToEndId. It is derived, not random, so a
    resumed Handler2 rebuilds the identical instruction and the rail can be
    probed by it after a lost response.
    """
    return "E2E" + derived_key(client_id, key, "e2e")[:32].upper()
