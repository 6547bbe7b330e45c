"""Webhook endpoints: where a client wants its events POSTed, and the secret they are signed with.

Managed from the command line (`payments clients create NAME --webhook-url
URL`, `payments clients set-webhook NAME URL`, `payments clients
remove-webhook NAME`), never over the API. The secret is in the Standard
Webhooks format (`whsec_` and base64 of 32 random bytes), generated here and
shown once, when the endpoint is created (or `--rotate-secret`). Unlike an
API key it cannot be stored as a hash (we sign every delivery with it): it
is stored sealed with WEBHOOK_SECRETS_KEY (sealing.py), never in the clear.
A URL is registered only if the egress policy takes it (egress.py).
A rotated-out secret is kept, and sent beside the new one, for an overlap
window (docs/outbox-inbox.md#rotating-a-signing-secret). An endpoint may
ask for several events in one POST (`--events-per-post N`,
docs/outbox-inbox.md#several-events-in-one-post).

An endpoint gets deliveries for the events written while it exists; a
changed URL receives the pending ones too (they are signed and sent to
whatever the endpoint is at the time of each attempt). Removing it cancels
the pending deliveries; the events stay in `GET /v1/events`.
"""

from __future__ import annotations

import base64
import secrets

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

# InvalidWebhookUrl: what checked_url raises, caught by its callers from here.
from app.outbox.egress import EgressPolicy, InvalidWebhookUrl  # noqa: F401
from app.outbox.events import AFTER_THE_CURSOR
from app.outbox.sealing import SecretsKey

SECRET_PREFIX = "whsec_"
# The most events one POST to an endpoint may carry (the column's CHECK,
# migration 0019); 1, the default, is the one-event Standard Webhooks message.
MAX_EVENTS_PER_POST = 100


def new_secret() -> str:
    # 32 bytes: the Standard Webhooks format allows 24 to 64.
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def checked_url(url: str, policy: EgressPolicy) -> str:
    """The URL if `policy` lets it be registered; InvalidWebhookUrl saying why not."""
    return policy.checked_url(url)


# A rotation keeps the current secret as the previous one, sent beside the
# new one until `previous_secret_until`. Any other change of the endpoint
# clears a previous secret whose window has ended.
_UPSERT = text(
    """
    INSERT INTO webhook_endpoint (client_id, url, secret_sealed, events_per_post)
    VALUES (:client_id, :url, :sealed, coalesce(CAST(:events_per_post AS smallint), 1))
    ON CONFLICT (client_id) DO UPDATE
       SET url = EXCLUDED.url,
           -- Not given: the endpoint keeps what it had.
           events_per_post = coalesce(CAST(:events_per_post AS smallint), webhook_endpoint.events_per_post),
           secret_sealed = CASE WHEN :rotate THEN EXCLUDED.secret_sealed ELSE webhook_endpoint.secret_sealed END,
           previous_secret_sealed = CASE
               WHEN :rotate THEN webhook_endpoint.secret_sealed
               WHEN webhook_endpoint.previous_secret_until > now() THEN webhook_endpoint.previous_secret_sealed
           END,
           previous_secret_until = CASE
               WHEN :rotate THEN now() + make_interval(secs => :overlap_seconds)
               WHEN webhook_endpoint.previous_secret_until > now() THEN webhook_endpoint.previous_secret_until
           END,
           updated_at = now()
    RETURNING (xmax = 0) AS created, previous_secret_until
    """
)
_REMOVE = text("DELETE FROM webhook_endpoint WHERE client_id = :client_id RETURNING url")
# The client's pending retries, and its events still waiting behind the
# dispatcher's cursor for a first attempt (app/outbox/delivery.py), which
# have no row yet: both end cancelled, so that what was not sent says why.
_CANCEL_PENDING = text(
    f"""
    WITH retries AS (
        UPDATE webhook_delivery
           SET state = 'cancelled', lease_token = NULL, lease_expires_at = NULL,
               last_error = 'the webhook endpoint was removed', updated_at = now()
         WHERE client_id = :client_id AND state = 'pending'
        RETURNING 1
    ), first AS (
        INSERT INTO webhook_delivery (event_id, client_id, state, last_error)
        SELECT e.id, e.client_id, 'cancelled', 'the webhook endpoint was removed'
          FROM event e
         WHERE e.client_id = :client_id AND {AFTER_THE_CURSOR}
        ON CONFLICT (event_id) DO NOTHING
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM retries) + (SELECT count(*) FROM first)
    """
)
_GET = text("SELECT url, secret_sealed FROM webhook_endpoint WHERE client_id = :client_id")
_SEALED = text(
    "SELECT client_id, secret_sealed, previous_secret_sealed FROM webhook_endpoint "
    "WHERE client_id > :after ORDER BY client_id LIMIT :limit"
)
_RESEAL = text(
    """
    UPDATE webhook_endpoint w
       SET secret_sealed = r.secret_sealed, previous_secret_sealed = r.previous_secret_sealed
      FROM unnest(CAST(:client_ids AS bigint[]), CAST(:secrets AS text[]), CAST(:previous AS text[]))
           AS r(client_id, secret_sealed, previous_secret_sealed)
     WHERE w.client_id = r.client_id
    """
)


async def set_endpoint(conn: AsyncConnection, client_id: int, url: str, key: SecretsKey, *,
                       rotate_secret: bool = False, overlap_seconds: float = 0.0,
                       events_per_post: int | None = None) -> str | None:
    """Create or change the client's endpoint; the secret if it is new (to show once), else None.

    `url` has passed the egress policy (`checked_url`). With `rotate_secret`,
    the current secret is still sent beside the new one for `overlap_seconds`.
    `events_per_post`: at most how many events one POST may carry
    (1 to MAX_EVENTS_PER_POST); None keeps the endpoint's, or 1 for a new one.
    """
    if events_per_post is not None and not 1 <= events_per_post <= MAX_EVENTS_PER_POST:
        raise ValueError(f"events per POST must be 1 to {MAX_EVENTS_PER_POST}, not {events_per_post}")
    secret = new_secret()
    row = (
        await conn.execute(
            _UPSERT, dict(client_id=client_id, url=url, sealed=key.seal(secret), rotate=rotate_secret,
                          overlap_seconds=overlap_seconds, events_per_post=events_per_post)
        )
    ).one()
    return secret if row.created or rotate_secret else None


async def remove_endpoint(conn: AsyncConnection, client_id: int) -> int | None:
    """Remove the endpoint and cancel its undelivered webhooks (how many); None if there was none."""
    if (await conn.execute(_REMOVE, dict(client_id=client_id))).one_or_none() is None:
        return None
    return (await conn.execute(_CANCEL_PENDING, dict(client_id=client_id))).scalar_one()


async def get_endpoint(conn: AsyncConnection, client_id: int, key: SecretsKey) -> tuple[str, str | None] | None:
    """(url, secret in the clear; None if `key` cannot open it), or None."""
    row = (await conn.execute(_GET, dict(client_id=client_id))).one_or_none()
    return None if row is None else (row.url, key.open(row.secret_sealed))


async def reseal_all(conn: AsyncConnection, key: SecretsKey, batch: int = 500) -> int:
    """Every endpoint's secrets sealed again under the first key of `key`; how many endpoints.

    InvalidToken if a secret was sealed by no key of `key` (nothing is then written).
    """
    after, count = 0, 0
    while rows := (await conn.execute(_SEALED, dict(after=after, limit=batch))).all():
        await conn.execute(_RESEAL, dict(
            client_ids=[r.client_id for r in rows],
            secrets=[key.reseal(r.secret_sealed) for r in rows],
            previous=[r.previous_secret_sealed and key.reseal(r.previous_secret_sealed) for r in rows],
        ))
        after, count = rows[-1].client_id, count + len(rows)
    return count
