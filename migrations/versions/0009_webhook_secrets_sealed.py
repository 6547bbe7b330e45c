"""Webhook signing secrets sealed at rest, and a rotated secret's overlap window.

`webhook_endpoint.secret` (the whsec_ secret in the clear) becomes
`secret_sealed`: the same secret sealed with WEBHOOK_SECRETS_KEY (Fernet,
app/outbox/sealing.py). A CHECK keeps a plaintext secret from being written
there again. `previous_secret_sealed` and `previous_secret_until`: after a
rotation, the old secret, sent beside the new one until then (both
signatures in webhook-signature).

The key: every existing secret is sealed here, so the migration needs the
key the service will open them with. `payments migrate` passes
WEBHOOK_SECRETS_KEY (from its environment) in the Alembic configuration's
attributes; `alembic upgrade` run by hand reads WEBHOOK_SECRETS_KEY itself.
With rows to seal and no key, the migration refuses (nothing changed) and
says so; with no rows it needs none. The first key of a comma-separated
list seals, as the service does.

On a large table: webhook_endpoint has one row per client with a webhook,
so it is small next to the payment tables. The new columns are nullable
with no default (a catalogue change); then every row is read, sealed in
Python and written back, in batches of BATCH rows by client_id, all in the
migration's transaction: the ADD COLUMN's ACCESS EXCLUSIVE lock is held
until the end, so the dispatcher's claims (which join webhook_endpoint)
wait for the whole migration, which takes time linear in the number of
endpoints (one Fernet encryption and one row rewritten each); deliveries
are late by that much, never lost. The NOT NULL and the CHECK are then
checked by one scan, and the plaintext column is dropped (a catalogue
change; its space is reclaimed by later vacuums).

The downgrade opens every secret again (it needs the key as well) and puts
it back in the clear; the overlap window's old secrets are dropped.
"""

import os

import sqlalchemy as sa
from alembic import context, op

revision = "0009"
down_revision = "0008"

BATCH = 1000


def _keys():
    """WEBHOOK_SECRETS_KEY's Fernet keys, from the caller (`payments migrate`) or the environment; None if unset."""
    from cryptography.fernet import Fernet, MultiFernet

    value = context.config.attributes.get("webhook_secrets_key") or os.environ.get("WEBHOOK_SECRETS_KEY")
    if not value:
        return None
    return MultiFernet([Fernet(k.strip()) for k in value.split(",") if k.strip()])


def _refuse(count: int, what: str):
    from app.admin import MigrationRefused

    return MigrationRefused(
        f"{count} webhook signing secrets must be {what} with WEBHOOK_SECRETS_KEY, and it is not set "
        "(generate one: openssl rand -base64 32 | tr '+/' '-_'; give the worker the same)"
    )


def _rewrite(source: str, target: str, transform) -> None:
    """target = transform(source) for every row, in batches by client_id."""
    conn = op.get_bind()
    after = 0
    while rows := conn.execute(
        sa.text(f"SELECT client_id, {source} FROM webhook_endpoint WHERE client_id > :after "
                "ORDER BY client_id LIMIT :limit"),
        dict(after=after, limit=BATCH),
    ).all():
        conn.execute(
            sa.text(
                f"UPDATE webhook_endpoint w SET {target} = r.value "
                "FROM unnest(CAST(:ids AS bigint[]), CAST(:values AS text[])) AS r(client_id, value) "
                "WHERE w.client_id = r.client_id"
            ),
            dict(ids=[r[0] for r in rows], values=[transform(r[1]) for r in rows]),
        )
        after = rows[-1][0]


def upgrade() -> None:
    count = op.get_bind().execute(sa.text("SELECT count(*) FROM webhook_endpoint")).scalar_one()
    keys = _keys()
    if count and keys is None:
        raise _refuse(count, "sealed")
    op.execute(
        """
        ALTER TABLE webhook_endpoint
            ADD COLUMN secret_sealed text,
            ADD COLUMN previous_secret_sealed text,
            ADD COLUMN previous_secret_until timestamptz
        """
    )
    if count:
        _rewrite("secret", "secret_sealed", lambda secret: keys.encrypt(secret.encode()).decode())
    op.execute(
        """
        ALTER TABLE webhook_endpoint
            ALTER COLUMN secret_sealed SET NOT NULL,
            -- Sealed, never a whsec_ secret in the clear.
            ADD CONSTRAINT webhook_endpoint_secret_sealed_check
                CHECK (secret_sealed NOT LIKE 'whsec\\_%' AND previous_secret_sealed NOT LIKE 'whsec\\_%'),
            DROP COLUMN secret
        """
    )


def downgrade() -> None:
    count = op.get_bind().execute(sa.text("SELECT count(*) FROM webhook_endpoint")).scalar_one()
    keys = _keys()
    if count and keys is None:
        raise _refuse(count, "opened")
    op.execute("ALTER TABLE webhook_endpoint ADD COLUMN secret text")
    if count:
        _rewrite("secret_sealed", "secret", lambda sealed: keys.decrypt(sealed.encode()).decode())
    op.execute(
        """
        ALTER TABLE webhook_endpoint
            ALTER COLUMN secret SET NOT NULL,
            ADD CONSTRAINT webhook_endpoint_secret_check CHECK (secret LIKE 'whsec\\_%'),
            DROP COLUMN secret_sealed,
            DROP COLUMN previous_secret_sealed,
            DROP COLUMN previous_secret_until
        """
    )
