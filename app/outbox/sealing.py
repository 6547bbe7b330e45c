"""Webhook signing secrets sealed at rest: the database holds ciphertext, WEBHOOK_SECRETS_KEY opens it.

Where it sits: between the endpoints' rows and the two things that need a
secret in the clear: registration seals a new secret before it is written
(app/outbox/endpoints.py), and the dispatcher opens a claimed delivery's
sealed secrets to sign it (app/outbox/delivery.py::claim). Fernet from the
`cryptography` package; WEBHOOK_SECRETS_KEY is one key, or `NEW,OLD` while
it rotates (the first seals, every one opens).
docs/outbox-inbox.md#signing-secrets-at-rest says why, and how the key is
provided and rotated.
"""

from __future__ import annotations

import binascii
import functools

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

GENERATE_HINT = "generate one: openssl rand -base64 32 | tr '+/' '-_'"


class UnusableKey(ValueError):
    """WEBHOOK_SECRETS_KEY is not one or more Fernet keys."""


def parse_keys(value: str) -> list[Fernet]:
    keys = [item.strip() for item in value.split(",") if item.strip()]
    if not keys:
        raise UnusableKey(f"is empty ({GENERATE_HINT})")
    try:
        return [Fernet(key) for key in keys]
    except (ValueError, binascii.Error):
        # Fernet's own message would say "32 url-safe base64-encoded bytes"
        # but not which one; the value itself is never repeated.
        raise UnusableKey(f"each key is 32 bytes in url-safe base64 ({GENERATE_HINT})") from None


class SecretsKey:
    """Seals and opens webhook signing secrets with WEBHOOK_SECRETS_KEY."""

    def __init__(self, value: str) -> None:
        self._keys = MultiFernet(parse_keys(value))
        # Opening the same sealed secret for every webhook to one merchant
        # would repeat the HMAC and AES for nothing: each is opened once.
        self.open_cached = functools.lru_cache(maxsize=1024)(self.open)

    def seal(self, secret: str) -> str:
        return self._keys.encrypt(secret.encode()).decode()

    def open(self, sealed: str) -> str | None:
        """The secret in the clear; None if no key of WEBHOOK_SECRETS_KEY sealed it."""
        try:
            return self._keys.decrypt(sealed.encode()).decode()
        except InvalidToken:
            return None

    def reseal(self, sealed: str) -> str:
        """The same secret sealed under the first key (InvalidToken if no key opens it)."""
        return self._keys.rotate(sealed.encode()).decode()


def new_key() -> str:
    """A fresh WEBHOOK_SECRETS_KEY (what `openssl rand -base64 32 | tr '+/' '-_'` prints)."""
    return Fernet.generate_key().decode()
