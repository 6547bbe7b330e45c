"""IBANs: parsed, validated and normalised in one place, by schwifty.

Where it sits: a leaf, imported by every layer that meets an IBAN. The
request model calls it while validating a payment's beneficiary (before
anything is stored or fingerprinted), the settings call it on
RAIL_LEGACY_ACCOUNTS at start-up, and so the rail client compares two
normalised IBANs. It imports nothing from `app`.

What "valid" means here is schwifty's IBAN check (ISO 13616 and the SWIFT
IBAN registry): a country that has IBANs, that country's exact length, the
BBAN's structure for that country (which positions are letters, which are
digits), and the mod-97 check digits. A hand-written pattern plus the check
digits would let through a made-up country code, or a German IBAN of the
wrong length.
Not checked: the national check digits inside the BBAN. They are known for
some countries only (Germany alone has over a hundred bank-specific methods),
and the rail is the authority on whether an account exists: a payout to a
well-formed account that does not exist is rejected and the charge refunded.

One spelling per IBAN: the electronic form, upper case with no spaces. The
print form (`de89 3704 0044 0532 0130 00`) is accepted and normalised, so a
retry written with spaces is the same payment (the same fingerprint) and a
legacy account is recognised however it was written in the configuration.
Only ASCII letters, digits and spaces are accepted: a tab, a newline or a
no-break space inside an account number is not a way of writing an IBAN but
a sign that the value was pasted from somewhere it should not have been.
"""

from __future__ import annotations

import re

from schwifty import IBAN
from schwifty.exceptions import SchwiftyException

# The longest IBAN is 34 characters; its print form adds a space per group of
# four. Anything much longer is refused before schwifty looks at it.
MAX_PRINT_LENGTH = 48
_PRINT_FORM = re.compile(r"[A-Za-z0-9 ]+")


def normalise(text: str) -> str:
    """The IBAN in `text` in its electronic form (`DE89370400440532013000`).

    Raises ValueError, with a message fit to show the person who wrote it,
    if `text` is not a valid IBAN.
    """
    if not isinstance(text, str):
        raise ValueError("an IBAN is a string")
    if len(text) > MAX_PRINT_LENGTH:
        raise ValueError(f"not a valid IBAN: longer than {MAX_PRINT_LENGTH} characters")
    if not _PRINT_FORM.fullmatch(text):
        raise ValueError("not a valid IBAN: only letters, digits and spaces are allowed")
    try:
        return IBAN(text).compact
    except SchwiftyException as exc:
        # schwifty's messages name what is wrong ("Unknown country-code 'XX'",
        # "Invalid IBAN length", "Invalid BBAN structure: ..."); keep them.
        raise ValueError(f"not a valid IBAN: {exc}") from None


def normalise_all(texts: str) -> frozenset[str]:
    """A comma-separated list of IBANs (RAIL_LEGACY_ACCOUNTS), each normalised.

    Empty entries are skipped; the first invalid one raises ValueError naming it.
    """
    accounts = set()
    for entry in texts.split(","):
        if not entry.strip():
            continue
        try:
            accounts.add(normalise(entry.strip()))
        except ValueError as exc:
            raise ValueError(f"{entry.strip()!r} is {exc}") from None
    return frozenset(accounts)
