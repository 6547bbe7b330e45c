"""IBANs: parsed, validated and normalised in one place, by schwifty.

Where it sits: a leaf, imported by every layer that meets an IBAN and
importing nothing from `app`: the request model validates a beneficiary's
IBAN with it (before anything is stored or fingerprinted), the settings
check RAIL_LEGACY_ACCOUNTS, and the rail client compares normalised IBANs.
One spelling per IBAN: the electronic form, upper case, no spaces.
docs/reference/http-edge.md#ibans-one-validation-one-spelling says what
"valid" means here, and what is left to the rail.
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
