"""Webhook endpoints: where a client wants its events POSTed, and the secret they are signed with.

Managed from the command line (`payments clients create NAME --webhook-url
URL`, `payments clients set-webhook NAME URL`, `payments clients
remove-webhook NAME`), never over the API. The secret is in the Standard
Webhooks format (`whsec_` and base64 of 32 random bytes), generated here and
shown once, when the endpoint is created (or `--rotate-secret`). Unlike an
API key it is stored as it is: we need it to sign every delivery.

An endpoint gets deliveries for the events written while it exists; a
changed URL receives the pending ones too (they are signed and sent to
whatever the endpoint is at the time of each attempt). Removing it cancels
the pending deliveries; the events stay in `GET /v1/events`.
"""

from __future__ import annotations

import base64
import secrets
from urllib.parse import urlsplit

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

SECRET_PREFIX = "whsec_"


class InvalidWebhookUrl(ValueError):
    """Not an absolute http(s) URL with a host."""


def new_secret() -> str:
    # 32 bytes: the Standard Webhooks format allows 24 to 64.
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def checked_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidWebhookUrl(f"a webhook URL is an absolute http:// or https:// URL, not {url!r}")
    return url


_UPSERT = text(
    """
    INSERT INTO webhook_endpoint (client_id, url, secret)
    VALUES (:client_id, :url, :secret)
    ON CONFLICT (client_id) DO UPDATE
       SET url = EXCLUDED.url,
           secret = CASE WHEN :rotate THEN EXCLUDED.secret ELSE webhook_endpoint.secret END,
           updated_at = now()
    RETURNING secret, (xmax = 0) AS created
    """
)
_REMOVE = text("DELETE FROM webhook_endpoint WHERE client_id = :client_id RETURNING url")
_CANCEL_PENDING = text(
    """
    UPDATE webhook_delivery
       SET state = 'cancelled', lease_token = NULL, lease_expires_at = NULL,
           last_error = 'the webhook endpoint was removed', updated_at = now()
     WHERE client_id = :client_id AND state = 'pending'
    """
)
_GET = text("SELECT url, secret FROM webhook_endpoint WHERE client_id = :client_id")


async def set_endpoint(conn: AsyncConnection, client_id: int, url: str, *, rotate_secret: bool = False) -> str | None:
    """Create or change the client's endpoint; the secret if it is new (to show once), else None."""
    row = (
        await conn.execute(
            _UPSERT, dict(client_id=client_id, url=checked_url(url), secret=new_secret(), rotate=rotate_secret)
        )
    ).one()
    return row.secret if row.created or rotate_secret else None


async def remove_endpoint(conn: AsyncConnection, client_id: int) -> int | None:
    """Remove the endpoint and cancel its pending deliveries (how many); None if there was none."""
    if (await conn.execute(_REMOVE, dict(client_id=client_id))).one_or_none() is None:
        return None
    return (await conn.execute(_CANCEL_PENDING, dict(client_id=client_id))).rowcount


async def get_endpoint(conn: AsyncConnection, client_id: int) -> tuple[str, str] | None:
    """(url, secret), or None."""
    row = (await conn.execute(_GET, dict(client_id=client_id))).one_or_none()
    return None if row is None else (row.url, row.secret)
